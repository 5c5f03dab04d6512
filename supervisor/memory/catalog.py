"""The models on this machine: which names can be loaded, where their files are, how big.

What a name refers to (a demo, a GGUF file or Ollama blob, a directory, a cached Hugging
Face repo) is protocol/model_ref.py, the rule the worker follows too; this is the
supervisor's policy over it and its view of the files, from the files alone: no MLX
import, nothing loaded. It feeds load-on-request (`target`, `request_target`), the memory
gate (`resolve`), `/v1/models` and `mlxctl models` (`scan`, `describe`).

Names come from clients, so nothing here may fail on one: absurd names (overlong, NUL,
lone surrogates) are turned away before they reach the filesystem, and every filesystem
error means "not a model". A request may only load what lies, by real path (symlinks and
`..` resolved), inside the model roots (`model_roots`): the admin decides what is
servable, not whoever can reach the port. The real path is also the model's identity:
every spelling of one directory is one worker.

`target` costs what model_ref.resolve does (a few stat calls); the rest (scan, sizes,
configs) reads more: call it from a thread.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from protocol import model_ref, models
from protocol.model_ref import LOOKUP_ERRORS, ModelRef, RefKind

log = logging.getLogger("mlxd.catalog")

WEIGHT_SUFFIXES = models.WEIGHT_SUFFIXES
# A name longer than this, or with a longer path component, names nothing (PATH_MAX is
# 1024 on macOS, NAME_MAX 255 on both): refused before any system call sees it.
MAX_NAME_BYTES = 1024
MAX_COMPONENT_BYTES = 255
_SEPARATORS = {b"/", os.sep.encode(), (os.altsep or "/").encode()}


@dataclass(frozen=True)
class LocalModel:
    id: str                    # the name to request it by
    path: str
    size_bytes: int            # weights on disk
    context_length: int | None
    source: str                # hf-cache | local | gguf | demo | demo-random
    modified: int = 0          # unix time the files were last written (/v1/models `created`)
    kind: str = "text"         # text | vision | embed | rerank | stt | tts (model_kind)

    def to_dict(self) -> dict:
        return asdict(self)


def sane_name(name: object) -> bool:
    """Whether `name` could name anything: a non-empty str, UTF-8 encodable (no lone
    surrogates), no NUL, within the length limits. Pure: no system call."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    if len(raw) > MAX_NAME_BYTES:
        return False
    parts = [raw]
    for sep in _SEPARATORS:
        parts = [piece for part in parts for piece in part.split(sep)]
    return all(len(part) <= MAX_COMPONENT_BYTES for part in parts)


def shown(name: object, limit: int = 120) -> str:
    """A client's model name as logs show it: repr'd (control characters and surrogates
    escaped) and cut short."""
    text = name if isinstance(name, str) else repr(name)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def real(path: Path | str) -> str:
    """`path` with `~`, symlinks and `..` resolved, as the OS will open it."""
    return os.path.realpath(Path(path).expanduser())


def reference(name: object, state_dir: Path) -> ModelRef | None:
    """What `name` refers to (protocol/model_ref.py), if it is a sane name at all."""
    return model_ref.resolve(name, state_dir) if sane_name(name) else None


def resolve(name: str, state_dir: Path) -> Path | None:
    """What holds `name`'s weights on this machine, for the memory gate: its directory, or
    a GGUF not converted yet (`weights_bytes` estimates it); None if nothing does."""
    found = reference(name, state_dir)
    try:
        return found.weights_path() if found is not None else None
    except LOOKUP_ERRORS:
        return None


@dataclass(frozen=True)
class Target:
    """Where a model name leads. `real`: its directory's real path, the model's identity
    (one worker per real path). `load_as`: what its worker is told to load: `demo` or
    `demo-random` (the worker builds them), a repo id (the worker looks it up in the same
    cache), or the real path itself, so the worker opens the very directory or GGUF file
    that was checked (an `ollama:` name: its blob)."""
    real: str
    load_as: str


def target(name: str, state_dir: Path) -> Target | None:
    """Where `name` leads, if it is a model on this machine (`demo` and the other demo
    names, built on first use; a directory with a config.json; a GGUF file or Ollama
    blob; a repo id in the local Hugging Face cache); else None. Never raises, whatever
    the name."""
    found = reference(name, state_dir)
    return _target(found) if found is not None else None


def _target(ref: ModelRef) -> Target | None:
    try:
        if ref.kind is RefKind.DEMO:
            return Target(real(ref.path), ref.name)
        if ref.gguf:
            where = real(ref.path)
            return Target(where, where)
        if ref.kind in (RefKind.DIRECTORY, RefKind.HUB) and (ref.path / "config.json").is_file():
            where = real(ref.path)
            return Target(where, ref.name if ref.kind is RefKind.HUB else where)
    except LOOKUP_ERRORS:
        pass
    return None


def loadable(name: str, state_dir: Path) -> bool:
    """Whether `name` is a model on this machine (see `target`)."""
    return target(name, state_dir) is not None


def model_roots(state_dir: Path, models_dirs=()) -> list[Path]:
    """Where load-on-request may load from, as real paths: the Hugging Face cache, the
    state directory's `models/` (where `demo` is built) and the `--models-dir` roots."""
    from huggingface_hub import constants

    roots = []
    for root in (constants.HF_HUB_CACHE, Path(state_dir) / "models", *models_dirs):
        try:
            roots.append(Path(real(root)))
        except LOOKUP_ERRORS:  # an unusable root admits nothing
            log.warning("model root %s is not a usable path; ignored", shown(str(root)))
    return roots


def inside(path: str, roots) -> bool:
    """Whether the real path `path` is one of `roots` or lies under one (both real:
    a lexical comparison is then exact)."""
    p = Path(path)
    return any(p == root or p.is_relative_to(root) for root in roots)


def refusal(name: str, found: Target | None, roots) -> str:
    """Why a request may not load `name`, whose `target` is `found`; "" if it may
    (`roots` None: anywhere). For the log and the admin only: a client gets one answer
    for all of these, or the answer would map the disk for it."""
    if not sane_name(name):
        return "not a possible model name (too long, NUL or not encodable)"
    if found is None:
        return "no model directory (with a config.json), GGUF file or cached repo by this name"
    if roots is not None and not inside(found.real, roots):
        return f"{found.real} is outside the model roots"
    return ""


def request_target(name: str, state_dir: Path, roots) -> Target | None:
    """Where `name` leads if a request may load it: a model on this machine inside the
    model roots."""
    found = target(name, state_dir)
    return found if not refusal(name, found, roots) else None


def modified(path: Path) -> int:
    try:
        return int(Path(path).stat().st_mtime)
    except OSError:
        return 0


weights_bytes = models.weights_bytes  # (protocol/models.py: the workers of a group use it too)


def read_config(path: Path) -> dict:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def context_length(path: Path, cap: int | None = None) -> int | None:
    # The rule the worker enforces (protocol/models.py), so /v1/models agrees with it.
    config = read_config(path)
    if not config:
        return None
    return models.context_length(config, cap)


def local_model(name: str, path: Path, source: str, cap: int | None = None) -> LocalModel:
    """A model directory as listed: its config read once for the context length (the rule
    the worker enforces) and the kind (the rule the worker picks its engine by)."""
    config = read_config(path)
    return LocalModel(name, str(path), weights_bytes(path),
                      models.context_length(config, cap) if config else None, source,
                      modified(path), models.model_kind(path, config).value)


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
        found.append(local_model(repo.repo_id, path, "hf-cache", cap))
    return sorted(found, key=lambda m: m.id)


def scan(state_dir: Path, cap: int | None = None, cache_dir: Path | None = None) -> list[LocalModel]:
    """Every local MLX model mlxd can serve by name: the HF cache, plus `demo`,
    and the other demo models once built (protocol.model_ref.BUILT_DEMOS)."""
    found = scan_hf_cache(cap, cache_dir)
    for name in model_ref.BUILT_DEMOS:
        path = model_ref.demo_dir(state_dir, name)
        if path.is_dir():
            found.append(local_model(name, path, name, cap))
    return found


def describe(name: str, state_dir: Path, cap: int | None = None) -> LocalModel | None:
    """One model by name (a loaded path model need not be in the HF cache); its `path`
    is the real one."""
    ref = reference(name, state_dir)
    found = _target(ref) if ref is not None else None
    if found is None or not Path(found.real).exists():  # `demo` before it is built
        return None
    path = Path(found.real)
    if ref.gguf:  # its context is known once converted
        done = ref.conversions()
        return LocalModel(name, str(path), weights_bytes(done[-1] if done else path),
                          context_length(done[-1], cap) if done else None, "gguf",
                          modified(path))
    source = {RefKind.DEMO: name, RefKind.HUB: "hf-cache"}.get(ref.kind, "local")
    return local_model(name, path, source, cap)
