"""Which model a snapshot belongs to: a KV state is only valid for the exact weights (and
cache layout) that computed it.

The identity is a hash of the model directory's real path, the name, size and mtime of
every weights file in it (a re-download or re-conversion changes them; for a Hugging Face
snapshot the path already names the revision), and the worker settings that change the
cache's layout (`--max-kv-size`: a rotating cache; `--kv-bits` and `--kv-group-size`: a
quantized one, so a snapshot is only ever resumed by a worker of the same KV format). Hashing the weights' bytes would be
exact but reads gigabytes at every load; size and mtime are what build tools trust too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from worker.kvcache.files import FORMAT

_WEIGHTS = (".safetensors", ".gguf", ".npz", ".bin")


def model_identity(path: Path, max_kv_size: Optional[int] = None, kv_format: str = "") -> str:
    """`kv_format`: worker/kvcache/quantized.py KVFormat.tag ("" for full precision)."""
    root = Path(path).resolve()
    parts: list = [FORMAT, str(root), max_kv_size]
    if kv_format:  # (full precision: the identities written before quantized KV existed)
        parts.append(kv_format)
    candidates = [root] if root.is_file() else sorted(root.iterdir())
    for f in candidates:
        if f.name.endswith(_WEIGHTS) or f.name == "config.json":
            st = f.stat()  # follows links: the HF cache links to its blobs
            parts.append((f.name, st.st_size, st.st_mtime_ns))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def snapshot_dir(state_dir: Path, identity: str) -> Path:
    return Path(state_dir) / "kv" / identity
