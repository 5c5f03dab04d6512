"""`mlxd`: serve models behind an OpenAI-compatible API.

Every flag can also be set by an MLXD_* environment variable (flags win), e.g.
MLXD_PORT=9000, MLXD_MODEL=demo (several models: comma-separated),
MLXD_MODELS_DIR=~/models:/Volumes/x/models (several roots: os.pathsep-separated).
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import sys
from dataclasses import fields
from pathlib import Path

from supervisor.config import Config, default_log_dir, default_state_dir, size

# (flag, Config field, type, help). Booleans are store_true flags.
OPTIONS = [
    ("--host", "host", str, "address to listen on"),
    ("--port", "port", int, "port to listen on"),
    ("--state-dir", "state_dir", Path, "where mlxd keeps its state (default: the platform's place)"),
    ("--log-dir", "log_dir", Path, "where logs go (default: ~/Library/Logs/mlxd on macOS, STATE_DIR/logs elsewhere)"),
    ("--max-queue", "max_queue", int, "requests waiting per model before 503"),
    ("--queue-timeout", "queue_timeout", float, "seconds a request may wait to start before 503"),
    ("--request-timeout", "request_timeout", float, "seconds a generation may run before it is cancelled (504)"),
    ("--cancel-grace", "cancel_grace", float, "seconds a worker has to answer a cancel before it is killed"),
    ("--heartbeat-timeout", "heartbeat_timeout", float, "seconds without a heartbeat before a worker counts as hung"),
    ("--hang-timeout", "hang_timeout", float, "seconds busy without progress before a worker counts as hung"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted (413 above)"),
    ("--max-models", "max_models", int, "resident models at most; the least recently used idle one is unloaded for another (0: memory decides)"),
    ("--memory-budget", "memory_budget", size, "memory the resident models may take in all, e.g. 24G (default: what the OS says is available)"),
    ("--memory-factor", "memory_factor", float, "a model needs its weights on disk times this, plus --kv-budget"),
    ("--kv-budget", "kv_budget", size, "memory allowed per model for KV cache and activations, e.g. 2G"),
    ("--memory-wait", "memory_wait", float, "seconds a load waits for memory to come back before it is refused (507)"),
    ("--memory-probe", "memory_probe", Path, argparse.SUPPRESS),  # tests: JSON file of readings
    ("--allow-load-on-request", "allow_load_on_request", bool, "a request naming a local model that is not loaded loads it (default on; --no-allow-load-on-request)"),
    ("--keep-alive", "keep_alive", float, "seconds idle before a model loaded on request is unloaded (0: never; --model ones stay)"),
    ("--shutdown-timeout", "shutdown_timeout", float, "SIGTERM/SIGINT: seconds to finish running requests before cancelling them"),
    ("--max-context-tokens", "max_context_tokens", int, "cap on prompt + completion tokens (default: the model's context)"),
    ("--prefill-step", "prefill_step", int, "prompt tokens per prefill chunk (cancel is checked between chunks)"),
    ("--heartbeat-interval", "heartbeat_interval", float, "seconds between worker heartbeats"),
    ("--stream-interval", "stream_interval", float, "seconds: tokens that come faster than this are streamed together (0: every token alone)"),
    ("--restart-backoff", "restart_backoff", float, "first delay before restarting a crashed worker"),
    ("--crash-budget", "crash_budget", int, "crashes within --crash-window before a model is marked broken"),
    ("--crash-window", "crash_window", float, "seconds over which crashes are counted"),
    ("--store-max-count", "store_max_count", int, "stored responses kept at most (oldest evicted)"),
    ("--store-max-age", "store_max_age", float, "seconds a stored response is kept"),
    ("--max-chain-depth", "max_chain_depth", int, "longest previous_response_id chain rebuilt"),
    ("--log-prompts", "log_prompts", bool, "allow prompt text in logs (off by default)"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--default-max-tokens", "default_max_tokens", int, "max_tokens for requests that give none (default: up to the context; 16 for /v1/completions)"),
    ("--default-temperature", "default_temperature", float, "temperature for requests that give none (default 1.0)"),
    ("--default-repetition-penalty", "default_repetition_penalty", float, "repetition_penalty for requests that give none (default: off)"),
]


def env_name(flag: str) -> str:
    return "MLXD_" + flag.lstrip("-").replace("-", "_").upper()


def build_parser(prog: str = "mlxd") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="a local path, a Hugging Face repo id in the local cache, or `demo` "
                        "(random weights, built locally); repeatable [MLXD_MODEL]")
    p.add_argument("--models-dir", action="append", default=None, metavar="DIR",
                   help="a directory requests may load models from (load on request takes "
                        "only models inside these, the Hugging Face cache and "
                        "STATE_DIR/models, by real path); repeatable "
                        f"[MLXD_MODELS_DIR, {os.pathsep!r}-separated]")
    defaults = {f.name: f.default for f in fields(Config)}
    for flag, name, typ, help_ in OPTIONS:
        if help_ is not argparse.SUPPRESS:
            help_ = f"{help_} [{env_name(flag)}]"
        if typ is bool:
            # A flag that is on by default can only be switched off: --no-FLAG.
            action = argparse.BooleanOptionalAction if defaults.get(name) is True else "store_true"
            p.add_argument(flag, action=action, default=None, help=help_)
        else:
            p.add_argument(flag, type=typ, default=None, help=help_)
    return p


def config_from(args: argparse.Namespace, environ=os.environ) -> Config:
    """Flags over MLXD_* environment over defaults."""
    kwargs = {}
    types = {f.name: f for f in fields(Config)}
    for flag, name, typ, _ in OPTIONS:
        value = getattr(args, name)
        if value is None and env_name(flag) in environ:
            raw = environ[env_name(flag)]
            try:
                value = raw.strip().lower() in ("1", "true", "yes", "on") if typ is bool else typ(raw)
            except ValueError:
                raise SystemExit(f"mlxd: {env_name(flag)}={raw!r} is not a valid {typ.__name__}")
        if value is not None:
            kwargs[name] = value
    assert set(kwargs) <= set(types)
    models = args.model or [m for m in environ.get("MLXD_MODEL", "").split(",") if m.strip()]
    kwargs["models"] = tuple(m.strip() for m in models)
    dirs = args.models_dir or environ.get("MLXD_MODELS_DIR", "").split(os.pathsep)
    kwargs["models_dirs"] = tuple(Path(d.strip()).expanduser() for d in dirs if d.strip())
    explicit_state = "state_dir" in kwargs
    state_dir = Path(kwargs.get("state_dir") or default_state_dir()).expanduser()
    kwargs["state_dir"] = state_dir
    if not kwargs.get("log_dir"):
        kwargs["log_dir"] = default_log_dir(state_dir, explicit_state)
    return Config(**kwargs)


def setup_logging(config: Config) -> None:
    level = getattr(logging, config.log_level.upper(), logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(level)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    logs = config.logs()
    logs.mkdir(parents=True, exist_ok=True)
    file = logging.handlers.RotatingFileHandler(logs / "mlxd.log", maxBytes=10 << 20, backupCount=3)
    file.setFormatter(fmt)
    root.addHandler(file)


def serve(config: Config) -> None:
    from aiohttp import web

    from supervisor.app import create_app

    if not config.models:
        raise SystemExit("mlxd: no model given: pass --model (a path, a Hugging Face id, or `demo`)")
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    setup_logging(config)
    log = logging.getLogger("mlxd")
    log.info("mlxd serving %s on http://%s:%d (state in %s)", ", ".join(config.models),
             config.host, config.port, config.state_dir)
    if config.allow_load_on_request:
        from supervisor.memory.catalog import model_roots

        log.info("requests may load models from: %s", ", ".join(
            str(r) for r in model_roots(config.state_dir, config.models_dirs)))
    # aiohttp's shutdown_timeout is its wait for handlers after our drain has already
    # cancelled what was left (app._drain_then_cancel): a cancel's grace is enough.
    web.run_app(create_app(config), host=config.host, port=config.port,
                handler_cancellation=True, print=None, access_log=None,
                shutdown_timeout=config.cancel_grace + 5)


def main(argv: list[str] | None = None) -> None:
    serve(config_from(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
