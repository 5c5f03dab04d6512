"""Find and load the model a worker serves.

MODEL is `demo` (a tiny random-weight model built locally once, in the state directory),
a local model directory, or a Hugging Face repo id looked up ONLY in the local HF cache:
a worker never downloads (a download belongs to `mlxctl pull`, where it can be seen and
interrupted, not inside a load that a supervisor is timing).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("worker.models")

DEFAULT_CONTEXT = 4096
# Where configs keep the trained context length, by model family, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


class LoadError(Exception):
    """A load failure with a message safe to show to the client."""


@dataclass
class LoadedModel:
    model: object
    tokenizer: object        # mlx-lm TokenizerWrapper
    path: Path
    context_length: int
    vocab_size: int | None
    random_weights: bool


def resolve(model: str, state_dir: Path) -> Path:
    """The local directory holding MODEL's files."""
    if model == "demo":
        from worker.demo import build_model

        return build_model(Path(state_dir) / "models" / "demo", "demo").path
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if model.startswith((".", "/", "~")) or local.exists():
        raise LoadError(f"model {model} is not a model directory")
    try:
        from mlx_lm.utils import hf_repo_to_path

        return hf_repo_to_path(model)  # local_files_only=True: never downloads
    except Exception:
        raise LoadError(
            f"model {model} is not a local path and not in the Hugging Face cache; "
            f"run `mlxctl pull {model}` or `huggingface-cli download {model}`") from None


def _config_value(config: dict, keys) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length(config: dict, override: int | None = None) -> int:
    """The context length to enforce: the override, else the config's, else 4096."""
    if override:
        return override
    return _config_value(config, _CONTEXT_KEYS) or DEFAULT_CONTEXT


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read config.json of the model: {e}") from None


def load(model: str, state_dir: Path, max_context_tokens: int | None = None) -> LoadedModel:
    import mlx_lm

    from worker.demo import is_random_weights

    path = resolve(model, state_dir)
    config = read_config(path)
    try:
        mlx_model, tokenizer = mlx_lm.load(str(path))
    except Exception as e:
        log.exception("loading %s failed", path)
        raise LoadError(f"could not load model {model}: {type(e).__name__}: {e}"[:500]) from None
    return LoadedModel(
        model=mlx_model,
        tokenizer=tokenizer,
        path=path,
        context_length=context_length(config, max_context_tokens),
        vocab_size=_config_value(config, ("vocab_size",)),
        random_weights=is_random_weights(path),
    )
