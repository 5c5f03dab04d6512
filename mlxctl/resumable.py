"""One Hugging Face file into the hub cache, resumable across interrupted pulls.

huggingface_hub (2.x) resumes a broken connection within one `hf_hub_download` call, but
it writes to a temporary name unique to the process and deletes it when the call fails,
so a pull stopped by Ctrl-C, a closed laptop or a network down for longer than its
retries started over. mlxctl keeps the partial bytes under a stable name in the cache's
blob folder (`<etag>.mlxd-part`, under a file lock so two pulls never write one file)
and hands the transfer itself to huggingface_hub's `http_get` with `resume_size`: the
same Range request, retries and fallback (a server that ignores the Range) as its own
downloads. The result is checked (size; SHA-256 where the etag is one, as for LFS
files) and moved to `blobs/<etag>`; `hf_hub_download` then finds the blob in place and
only links it into the snapshot and writes the ref, so the layout stays huggingface_hub's.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlparse

CHUNK = 1 << 20
PART = ".mlxd-part"     # what `mlxctl rm` also deletes with the repo's folder


class Incomplete(OSError):
    """The bytes that arrived are not the file the etag names."""


def blob_path(repo: str, etag: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
            / "blobs" / etag)


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs share scheme, host and port. The token goes only to the Hub that
    listed the file: a redirect elsewhere (an LFS CDN, signed) gets no Authorization,
    as in huggingface_hub's own downloads."""
    pa, pb = urlparse(a), urlparse(b)
    ports = {"http": 80, "https": 443}
    return ((pa.scheme, (pa.hostname or "").lower(), pa.port or ports.get(pa.scheme))
            == (pb.scheme, (pb.hostname or "").lower(), pb.port or ports.get(pb.scheme)))


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(CHUNK):
            h.update(piece)
    return h.hexdigest()


def fetch(url: str, dest: Path, size: int | None, etag: str, bar, headers: dict) -> None:
    """The bytes at `url` into `dest`, continuing `dest.mlxd-part` if an earlier pull
    left one. `bar` is the tqdm-like class that reports progress. Raises on failure,
    keeping what arrived for the next pull."""
    from filelock import FileLock
    from huggingface_hub.file_download import http_get

    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + PART)
    lock = Path(str(part) + ".lock")
    with FileLock(str(lock)):
        if dest.exists():
            return
        have = part.stat().st_size if part.exists() else 0
        if size is not None and have > size:   # not this file's bytes: start again
            have = 0
        with open(part, "r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            http_get(url, f, resume_size=have, headers=headers, expected_size=size,
                     displayed_filename=dest.name, tqdm_class=bar)
        got = part.stat().st_size
        if size is not None and got != size:
            raise Incomplete(f"{got} of {size} bytes arrived; pull again to resume")
        if re.fullmatch(r"[0-9a-f]{64}", etag) and _sha256_of(part) != etag:
            part.unlink()
            raise Incomplete("the bytes received do not match their SHA-256; the partial "
                             "file was removed, pull again")
        os.replace(part, dest)
    lock.unlink(missing_ok=True)
