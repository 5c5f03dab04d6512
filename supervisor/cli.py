"""`mlxd`: serve models behind an OpenAI-compatible API.

Settings come from, highest first: flags; MLXD_* environment variables (MLXD_PORT=9000;
MLXD_MODEL=demo,/m/x is comma-separated; MLXD_MODELS_DIR is os.pathsep-separated); a TOML
file (--config, MLXD_CONFIG, else the platform's default file if it exists) whose keys are
the settings' names (queue_timeout = 30, models = ["demo"], kv_budget = "2G"); the
defaults. `mlxd --print-config` shows every effective value and where it came from.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import os
import stat
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

from protocol.settings import SETTINGS, Setting, add_flag
from supervisor.config import Config, ConfigError, Resolved, default_config_path, resolve


def _help(s: Setting) -> str:
    """The setting's help with its variable and its one default, from the table."""
    default = "" if s.optional or s.factory or s.default in ((), "") else s.show(s.default)
    return f"{s.help} [{s.env}{'; default: ' + default if default else ''}]"


def build_parser(prog: str = "mlxd") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                usage="%(prog)s [--model MODEL] [--config PATH] [--print-config] "
                                      "[options]",  # the full list is --help's
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None, metavar="PATH",
                   help="a TOML file of settings; a missing one is an error "
                        f"[MLXD_CONFIG; default: {default_config_path()}, if it exists]"
                        .replace("%", "%%"))
    p.add_argument("--print-config", nargs="?", const="table", choices=("table", "json"),
                   default=None, metavar="table|json",
                   help="print every setting's effective value and where it came from "
                        "(flag, env, file, default), then exit")
    for s in SETTINGS:
        add_flag(p, s, help=_help(s))
    return p


def resolved_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Resolved:
    """Flags over MLXD_* environment over the config file over defaults."""
    return resolve({s.name: getattr(args, s.name) for s in SETTINGS}, environ, args.config)


def config_from(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Config:
    return resolved_from(args, environ).config


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def print_config(resolved: Resolved, fmt: str = "table", out: TextIO = sys.stdout) -> None:
    config, sources = resolved.config, resolved.sources
    file_note = "" if resolved.file_read else " (not found: defaults apply)"
    if fmt == "json":
        json.dump({"config_file": str(resolved.file), "config_file_read": resolved.file_read,
                   "settings": {s.name: {"value": s.show(getattr(config, s.name)) if s.secret
                                         else _jsonable(getattr(config, s.name)),
                                         "source": sources[s.name]} for s in SETTINGS}},
                  out, indent=2)
        out.write("\n")
        return
    rows = [("setting", "value", "source")]
    rows += [(s.name, s.show(getattr(config, s.name)), sources[s.name]) for s in SETTINGS]
    # (secrets: `show` gives how many are set, never the values)
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    out.write(f"config file: {resolved.file}{file_note}\n")
    for name, value, source in rows:
        out.write(f"{name:<{widths[0]}}  {value:<{widths[1]}}  {source}\n")


def setup_logging(config: Config) -> None:
    level = getattr(logging, config.log_level.upper(), logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(level)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    logs = config.logs()
    private_dir(logs)
    file = PrivateRotatingFileHandler(logs / "mlxd.log", maxBytes=10 << 20, backupCount=3)
    file.setFormatter(fmt)
    root.addHandler(file)


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Log files readable by their owner only (0600), the current one and each new one
    after a rollover: they hold request ids, model paths and errors."""

    def _open(self):
        stream = super()._open()
        try:
            os.chmod(self.baseFilename, 0o600)
        except OSError:
            pass
        return stream


def private_dir(path: Path) -> None:
    """Create `path` (0700), or tighten it if group or others may enter it (logged)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        os.chmod(path, 0o700)
        logging.getLogger("mlxd").warning("%s was mode %o: tightened to 700", path, mode)


def serve(config: Config) -> None:
    from supervisor.app import create_app
    from supervisor.http import guard, serving

    private_dir(config.state_dir)
    setup_logging(config)
    log = logging.getLogger("mlxd")
    try:
        guard.check_startup(config)
    except (guard.KeyFileError, guard.ExposedError) as e:
        log.error("%s", e)
        raise ConfigError(str(e)) from None
    log.info("mlxd serving %s on http://%s:%d (state in %s)", ", ".join(config.models),
             config.host, config.port, config.state_dir)
    if config.allow_load_on_request:
        from supervisor.memory.catalog import model_roots

        log.info("requests may load models from: %s", ", ".join(
            str(r) for r in model_roots(config.state_dir, config.models_dirs)))
    serving.run(create_app(config), config)


def check_hosts(config) -> None:
    """Worker groups: a bad hostfile stops mlxd here, before anything starts, not at a
    load."""
    if config.hosts is None:
        return
    from protocol.hosts import read_hostfile

    try:
        read_hostfile(config.hosts)
    except ValueError as e:
        raise ConfigError(f"--hosts: {e}") from None


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)  # bad flags: argparse's usage line, status 2
    try:
        resolved = resolved_from(args)
        if args.print_config:
            print_config(resolved, args.print_config)
            return
        if not resolved.config.models:
            raise ConfigError("no model given: pass --model (a path, a Hugging Face id, or "
                              "`demo`), or set MLXD_MODEL or `models` in the config file")
        check_hosts(resolved.config)
        serve(resolved.config)
    except ConfigError as e:  # one line and the status argparse uses for bad usage
        print(f"mlxd: {e.message}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
