"""Deleting a model from the local Hugging Face cache (`mlxctl rm`, `POST /admin/delete`).

Only a repo id (`org/name`, as huggingface_hub validates it) is deleted, and only its
folder in the hub cache (`models--org--name`: every revision, blob and ref, and what an
interrupted pull left there), so nothing else is ever removed: never a local model
directory, a path, or the state directory's demo models. The folder is found by its
name, not through huggingface_hub's cache scan, because the scan skips a folder with no
snapshot yet (a first pull stopped half way), whose partial blobs are what a user most
wants gone. Whoever calls this has made sure the model is not loaded.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from protocol.model_ref import looks_like_repo_id


class NotCached(Exception):
    """The repo is not in the cache."""


def repo_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    """`repo_id`'s folder in the hub cache (HF_HUB_CACHE unless given). ValueError for a
    name that is not a repo id."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if not looks_like_repo_id(repo_id):
            raise HFValidationError(repo_id)
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"{repo_id[:200]!r} is not a Hugging Face repo id (org/name); only "
                         "models in the Hugging Face cache are deleted") from None
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
    return cache / repo_folder_name(repo_id=repo_id, repo_type="model")


def size_on_disk(folder: Path) -> int:
    """The bytes of the files under `folder` (blobs and partial files; the snapshots'
    links count nothing)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def delete_cached(repo_id: str, cache_dir: Path | None = None) -> tuple[Path, int]:
    """Remove `repo_id`'s folder from the hub cache: (the folder, bytes freed).
    ValueError for a name that is not a repo id; NotCached when it is not there."""
    folder = repo_folder(repo_id, cache_dir)
    if folder.is_symlink() or not folder.is_dir():
        raise NotCached(repo_id)
    freed = size_on_disk(folder)
    shutil.rmtree(folder)
    # huggingface_hub's per-repo lock files, if any: nothing else names them.
    shutil.rmtree(folder.parent / ".locks" / folder.name, ignore_errors=True)
    return folder, freed
