"""What both processes agree on about a model's files: what the model does, the context
it enforces, its GGUF conversions and the weights the memory gate counts.

The supervisor (which never loads a model) and the worker (which does) must give the same
answers to "what context length does this config.json mean?" and "is this an embedding
model?", or /v1/models would promise a context the worker then refuses. What a model
*name* refers to is protocol/model_ref.py. Pure: no MLX, no aiohttp, no disk beyond a few
stats and reads.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from protocol.messages import ModelKind

DEFAULT_CONTEXT = 4096   # when a config names no context length
# Where configs keep the trained context length, by model family, in order of preference.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


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
