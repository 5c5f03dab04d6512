"""The models on this machine: which names can be loaded, where their files are, how big.

A model name is `demo`, a local model directory, or a Hugging Face repo id present in the
local Hugging Face cache (mlxd never downloads at request time; `mlxctl pull` does). This
is the supervisor's view, from the files alone: no MLX import, nothing loaded. It feeds
load-on-request (`loadable`), the memory gate (`weights_bytes`), `/v1/models` and
`mlxctl models` (`scan`). Everything here touches the disk: call it from a thread.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("mlxd.catalog")

DEMO = "demo"
WEIGHT_SUFFIXES = (".safetensors",)


@dataclass(frozen=True)
class LocalModel:
    id: str                    # the name to request it by
    path: str
    size_bytes: int            # weights on disk
    context_length: int | None
    source: str                # hf-cache | local | demo
    modified: int = 0          # unix time the files were last written (/v1/models `created`)

    def to_dict(self) -> dict:
        return asdict(self)


def demo_path(state_dir: Path) -> Path:
    # Where worker.models builds `demo` (worker/models.py resolve()).
    return Path(state_dir) / "models" / DEMO


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~"))


def looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not looks_like_path(name)


def hf_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of `repo_id`, without touching the network."""
    if not looks_like_repo_id(repo_id):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed id or cache: not loadable, never a crash
        return None
    return Path(found).parent if isinstance(found, str) else None


def resolve(name: str, state_dir: Path) -> Path | None:
    """The directory holding `name`'s files, or None if it is not on this machine."""
    if name == DEMO:
        path = demo_path(state_dir)
        return path if path.is_dir() else None
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if looks_like_path(name):
        return None
    return hf_snapshot(name)


def loadable(name: str, state_dir: Path) -> bool:
    """Whether a request may load `name`: `demo` (built on first use), a local directory
    with a config.json, or a repo id in the local Hugging Face cache."""
    if name == DEMO:
        return True
    path = resolve(name, state_dir)
    return path is not None and (path / "config.json").is_file()


def modified(path: Path) -> int:
    try:
        return int(Path(path).stat().st_mtime)
    except OSError:
        return 0


def weights_bytes(path: Path | None) -> int:
    """Bytes of weights on disk (symlinks followed, as in the HF cache)."""
    if path is None:
        return 0
    files = [p for p in Path(path).iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]
    total = 0
    for p in files:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def read_config(path: Path) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def context_length(path: Path, cap: int | None = None) -> int | None:
    # The worker's own rule (worker/models.py: pure, no MLX), so /v1/models agrees with
    # what a loaded worker will enforce.
    from worker.models import context_length as worker_context_length

    config = read_config(path)
    if not config:
        return None
    return worker_context_length(config, cap)


def safetensors_format(file: Path) -> str | None:
    """The `format` in a safetensors header's metadata ("mlx" for MLX-saved weights)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta.get("format") if isinstance(meta, dict) else None


def is_mlx_model(path: Path, repo_id: str = "") -> bool:
    """MLX format: weights saved by MLX (mlx-lm writes metadata format "mlx"), an
    mlx-lm quantization block, or the mlx-community organisation."""
    if not (Path(path) / "config.json").is_file():
        return False
    if repo_id.lower().startswith("mlx-community/"):
        return True
    weights = sorted(p for p in Path(path).iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        return False
    if safetensors_format(weights[0]) == "mlx":
        return True
    return "quantization" in read_config(path)


def scan_hf_cache(cap: int | None = None, cache_dir: Path | None = None) -> list[LocalModel]:
    """MLX models in the local Hugging Face cache (their `main` revision, else the newest)."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    except Exception as e:  # a corrupted cache must not break /v1/models
        log.warning("could not scan the Hugging Face cache: %s", e)
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        path = Path(revs[-1].snapshot_path)
        if not is_mlx_model(path, repo.repo_id):
            continue
        found.append(LocalModel(repo.repo_id, str(path), weights_bytes(path),
                                context_length(path, cap), "hf-cache", modified(path)))
    return sorted(found, key=lambda m: m.id)


def scan(state_dir: Path, cap: int | None = None, cache_dir: Path | None = None) -> list[LocalModel]:
    """Every local MLX model mlxd can serve by name: the HF cache, plus `demo` once built."""
    models = scan_hf_cache(cap, cache_dir)
    demo = demo_path(state_dir)
    if demo.is_dir():
        models.append(LocalModel(DEMO, str(demo), weights_bytes(demo),
                                 context_length(demo, cap), "demo", modified(demo)))
    return models


def describe(name: str, state_dir: Path, cap: int | None = None) -> LocalModel | None:
    """One model by name (a loaded path model need not be in the HF cache)."""
    path = resolve(name, state_dir)
    if path is None:
        return None
    source = DEMO if name == DEMO else ("local" if Path(name).expanduser().is_dir() else "hf-cache")
    return LocalModel(name, str(path), weights_bytes(path), context_length(path, cap), source,
                      modified(path))
