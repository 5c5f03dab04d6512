"""What both processes agree on about a model: its names and the context it enforces.

The supervisor (which never loads a model) and the worker (which does) must give the same
answers to "where is `demo`?" and "what context length does this config.json mean?", or
/v1/models would promise a context the worker then refuses. Pure: no MLX, no aiohttp, no
disk beyond what the caller reads.
"""

from __future__ import annotations

from pathlib import Path

DEMO = "demo"            # the tiny random-weight model built locally, never downloaded
DEFAULT_CONTEXT = 4096   # when a config names no context length
# Where configs keep the trained context length, by model family, in order of preference.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


def demo_path(state_dir: Path) -> Path:
    """Where `demo` is built: inside the state directory's model root."""
    return Path(state_dir) / "models" / DEMO


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
    """The context length to enforce: the override, else the config's, else 4096."""
    if override:
        return override
    return config_value(config, CONTEXT_KEYS) or DEFAULT_CONTEXT
