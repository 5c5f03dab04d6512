"""Put a local model directory into a Hugging Face cache layout (blobs, snapshots,
refs/main), as `huggingface-cli download` leaves it: tests of cache lookups and
load-on-request by repo id, with nothing downloaded; `hf_cache`, the fixture of an empty
cache that huggingface_hub's lookups use."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def add_to_cache(src: Path, cache_dir: Path, repo_id: str) -> Path:
    """Returns the snapshot directory."""
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache that huggingface_hub's lookups use."""
    import huggingface_hub.constants as constants
    import huggingface_hub.utils._cache_manager as manager

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(manager, "HF_HUB_CACHE", str(cache))
    return cache
