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

from protocol import models as shared

log = logging.getLogger("worker.models")

DEFAULT_CONTEXT = shared.DEFAULT_CONTEXT


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
    if model == shared.DEMO:
        from worker.demo import build_model

        return build_model(shared.demo_path(state_dir), "demo").path
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


# One rule on both sides of the protocol (protocol/models.py).
context_length = shared.context_length
_config_value = shared.config_value


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
