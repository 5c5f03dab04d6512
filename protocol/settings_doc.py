"""docs/configuration.md, generated from the settings table.

Why generated: the table (protocol/settings.py) already feeds `mlxd --help`,
`--print-config`, the config file's keys and the workers' flags; a reference written by
hand beside it drifted (settings missing, defaults stale). `make docs` writes the file
(`python -m protocol.settings_doc docs/configuration.md`), and tests/test_docs.py fails
when the file differs from what `markdown()` gives now.

The output depends on the table only (never on this machine: a default known only at
run time is described, not computed), so every machine regenerates the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from protocol.settings import BOOL, SETTINGS, Setting

HEADER = """\
# Configuration

<!-- Generated from mlxd's settings table by `make docs`: do not edit by hand (a test
fails when this file is stale). -->

Every setting can be given three ways; **flags win over `MLXD_*` variables, which win
over the config file, which wins over the defaults**:

- a flag: `--queue-timeout 30` (switches also come as `--no-…`, to turn off what the file
  turns on; list settings repeat the flag);
- an environment variable: `MLXD_QUEUE_TIMEOUT=30` (a list is comma-separated:
  `MLXD_MODEL=demo,/m/x`; a list of paths is `os.pathsep`-separated, `:` on macOS and
  Linux);
- a TOML file: `--config PATH` (or `MLXD_CONFIG`); without one, mlxd reads
  `~/Library/Application Support/mlxd/config.toml` (macOS) or
  `$XDG_CONFIG_HOME/mlxd/config.toml` (default `~/.config/mlxd/config.toml`) if it
  exists; a file named but missing is an error. Keys are the settings' names below
  (`models` for `--model`, `models_dirs` for `--models-dir`); relative paths are relative
  to the file; sizes are bytes or strings such as `"2G"`. An unknown key or a value of the
  wrong type stops mlxd with one line naming it (exit status 2). A file that sets
  `api_key` must be mode 600.

```toml
models = ["mlx-community/Qwen2.5-7B-Instruct-4bit"]
port = 8081
queue_timeout = 30
kv_budget = "2G"
log_prompts = false
kv_bits = 8

# One model's own settings (tables come after the plain keys): its workers run with these
# instead of the server's. The KV format (kv_bits, kv_group_size) is per model.
[model_settings."mlx-community/Qwen2.5-7B-Instruct-4bit"]
kv_bits = 4
kv_group_size = 32
```

As a flag or variable, one model's setting is `MODEL:SETTING=VALUE`
(`--model-setting demo:kv_bits=8`); the last one given for a model and setting wins.

`mlxd --print-config` prints every setting's effective value and where it came from
(`flag --port`, `env MLXD_PORT`, `file PATH`, `default`), then exits without starting
anything (`--print-config json` for a machine); API keys are never printed, only how many
are set. `mlxd --help` lists every flag with its variable and default.

The state directory (`--state-dir`) defaults to `~/Library/Application Support/mlxd` on
macOS and `$XDG_STATE_HOME/mlxd` elsewhere (`~/.local/state/mlxd` without the variable).
Everything mlxd writes goes under it (models it builds, the response store, KV snapshots,
the admin token; the logs too, except on macOS without `--state-dir`), so two servers with different state
directories never touch each other.

Sizes take binary units (`512M`, `2G`, `1.5g`: powers of 1024). Times are in seconds.
Settings marked *worker* are passed on to every worker process as its own flag.
How the settings act together (the memory gate, batching, the prompt cache, snapshots,
who may call the server) is in [operations.md](operations.md).

## Settings

| flag | environment | file key | value | default | what it does |
| --- | --- | --- | --- | --- | --- |
"""

HOOKS = """
## Test hooks

Not listed by `mlxd --help`; for mlxd's own tests.

| flag | environment | file key | value | default | what it does |
| --- | --- | --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(s: Setting) -> str:
    if s.kind is BOOL:
        return f"`{s.flag}`, `--no-{s.flag[2:]}`"
    return f"`{s.flag}`"


def _env(s: Setting) -> str:
    sep = s.kind.separator
    if sep is None:
        return f"`{s.env}`"
    return f"`{s.env}` ({'comma' if sep == ',' else '`os.pathsep`'}-separated)"


def _default(s: Setting) -> str:
    if s.factory is not None:
        return "see above"      # computed on the machine that runs mlxd
    return s.show(s.default)


def _what(s: Setting) -> str:
    notes = []
    if s.secret:
        notes.append("never shown: `--print-config` says how many are set")
    if s.worker:
        notes.append("*worker*")
    return s.help + (f" ({'; '.join(notes)})" if notes else "")


def _row(s: Setting) -> str:
    cells = (_flags(s), _env(s), f"`{s.name}`", s.kind.what, _default(s), _what(s))
    return "| " + " | ".join(_cell(c) for c in cells) + " |\n"


def markdown() -> str:
    """The whole of docs/configuration.md."""
    shown = [s for s in SETTINGS if not s.hidden]
    hidden = [s for s in SETTINGS if s.hidden]
    text = HEADER + "".join(_row(s) for s in shown)
    if hidden:
        text += HOOKS + "".join(_row(s) for s in hidden)
    return text


def main(argv: list[str] = sys.argv[1:]) -> None:
    """`python -m protocol.settings_doc [PATH]`: write the reference to PATH (stdout
    without one)."""
    if not argv:
        sys.stdout.write(markdown())
        return
    Path(argv[0]).write_text(markdown(), encoding="utf-8")


if __name__ == "__main__":
    main()
