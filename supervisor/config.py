"""Server configuration: one frozen dataclass, filled from flags over MLXD_* environment.

Everything mlxd writes goes under `state_dir` (models it builds, the response store,
logs), so two servers with different state dirs never touch each other.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


def default_state_dir() -> Path:
    """The platform's proper place for mlxd's state."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxd"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlxd"


def default_log_dir(state_dir: Path, explicit_state_dir: bool) -> Path:
    """macOS keeps logs in ~/Library/Logs unless a state dir was given explicitly."""
    if sys.platform == "darwin" and not explicit_state_dir:
        return Path.home() / "Library" / "Logs" / "mlxd"
    return state_dir / "logs"


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def size(text: str) -> int:
    """Bytes from "12G", "512MiB", "1.5g" or a plain number (binary units: memory is
    counted in GiB everywhere in mlxd)."""
    raw = str(text).strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits):]
    if unit not in _UNITS or not digits:
        raise ValueError(f"not a size: {text!r}")
    return int(float(digits) * _UNITS[unit])


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8080
    state_dir: Path = field(default_factory=default_state_dir)
    log_dir: Path | None = None
    # Admission and time limits (seconds).
    max_queue: int = 64              # requests waiting per model beyond those running
    queue_timeout: float = 60.0      # waiting longer than this → 503 with Retry-After
    request_timeout: float = 600.0   # generating longer than this → cancelled, 504
    cancel_grace: float = 5.0        # a cancel unanswered this long → SIGKILL, respawn
    heartbeat_timeout: float = 15.0  # no heartbeat this long → the worker is hung
    hang_timeout: float = 120.0      # busy with no step progress this long → hung
    max_body_bytes: int = 16 * 1024 * 1024
    # Resident models and the memory gate (DESIGN.md, "Lifecycle and cancellation").
    max_models: int = 0              # resident models at most; 0: only memory decides
    memory_budget: int | None = None # bytes the resident models' estimates may total
    memory_factor: float = 1.2       # need = weights on disk × this + kv_budget
    kv_budget: int = 1 << 30         # bytes of KV cache and activations allowed per model
    memory_wait: float = 30.0        # a load waits this long for memory, then 507
    memory_probe: Path | None = None # tests: a JSON file whose readings replace the OS's
    allow_load_on_request: bool = True   # a request may load a local path / cached id
    # Where, besides the HF cache and STATE_DIR/models, a request may load models from
    # (by real path); admin loads may name any path.
    models_dirs: tuple[Path, ...] = ()
    keep_alive: float = 300.0        # idle seconds before an on-request model unloads; 0: never
    shutdown_timeout: float = 30.0   # SIGTERM/SIGINT: drain this long, then cancel the rest
    # Passed to workers.
    max_context_tokens: int | None = None
    prefill_step: int = 512
    heartbeat_interval: float = 1.0
    # Decode steps that come faster than this travel (and stream) together: one message
    # and one SSE chunk per interval instead of per token. Real models on Apple Silicon
    # take longer than this per token, so for them every token still goes out at once.
    stream_interval: float = 0.01
    # Restarts: exponential backoff; more than `crash_budget` crashes within
    # `crash_window` seconds marks the model broken (visible in /health).
    restart_backoff: float = 0.5
    restart_backoff_max: float = 30.0
    crash_budget: int = 5
    crash_window: float = 300.0
    # The Responses API store: bounded by count and age (seconds); chain depth limit.
    store_max_count: int = 10_000
    store_max_age: float = 30 * 86400.0
    max_chain_depth: int = 100
    log_prompts: bool = False
    log_level: str = "info"
    # Generation defaults for what a request leaves out (None: the endpoint's own
    # default: up to the context for chat, 16 for legacy completions; 1.0; none).
    default_max_tokens: int | None = None
    default_temperature: float | None = None
    default_repetition_penalty: float | None = None

    def logs(self) -> Path:
        return self.log_dir or self.state_dir / "logs"
