"""Server configuration: one frozen `Config`, its fields and defaults those of the settings
table (protocol/settings.py), its values from flags over MLXD_* environment over a TOML
file over the defaults.

Every value remembers where it came from (`Resolved.sources`), so `mlxd --print-config`
can say why a server runs with what it runs with. A configuration mlxd cannot run with
(an unknown key, a value of the wrong type, a missing file that was asked for) is a
`ConfigError`: one line naming the setting and where it was set, never a traceback.

Everything mlxd writes goes under `state_dir` (models it builds, the response store,
logs), so two servers with different state dirs never touch each other.
"""

from __future__ import annotations

import difflib
import os
import stat
import sys
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Mapping

from protocol.settings import BY_NAME, SETTINGS, Setting, default_state_dir, size

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["Config", "ConfigError", "Resolved", "default_config_path", "default_log_dir",
           "default_state_dir", "read_file", "resolve", "size"]

DEFAULT = "default"


def default_log_dir(state_dir: Path, explicit_state_dir: bool) -> Path:
    """macOS keeps logs in ~/Library/Logs unless a state dir was given explicitly."""
    if sys.platform == "darwin" and not explicit_state_dir:
        return Path.home() / "Library" / "Logs" / "mlxd"
    return state_dir / "logs"


def default_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the config file is looked for when none is named: the platform's place."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlxd" / "config.toml"
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlxd" / "config.toml"


def _field(s: Setting):
    typ = s.kind.type | None if s.optional else s.kind.type
    default = field(default_factory=s.factory) if s.factory else field(default=s.default)
    return s.name, typ, default


def _logs(self) -> Path:
    return self.log_dir or self.state_dir / "logs"


Config = make_dataclass(
    "Config", [_field(s) for s in SETTINGS], frozen=True,
    namespace={"logs": _logs, "__module__": __name__,
               "__doc__": "The server's settings; see protocol/settings.py for each one."})


class ConfigError(SystemExit):
    """A configuration mlxd cannot run with. A SystemExit, so that no caller (mlxd,
    `mlxctl service install`) can let it out as a traceback; mlxd exits 2 with `message`."""

    def __init__(self, message: str):
        super().__init__(f"mlxd: {message}")
        self.message = message


# ---- the sources, lowest first -----------------------------------------------------------

def read_file(path: Path) -> dict[str, Any]:
    """The settings a TOML file sets, checked against the table. Relative paths in it are
    relative to the file (a service's working directory is not the file's)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    values = {}
    for key, raw in data.items():
        setting = BY_NAME.get(key)
        if setting is None:
            close = difflib.get_close_matches(key.replace("-", "_"), BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown setting {key!r}{hint}")
        try:
            value = setting.kind.toml(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: {key} must be {setting.kind.what}, "
                              f"not {_toml_repr(raw)}") from None
        values[key] = _relative_to(path.parent, value)
    secrets = [key for key in values if BY_NAME[key].secret]
    mode = stat.S_IMODE(path.stat().st_mode)
    if secrets and mode & 0o077:  # as --api-key-file refuses a file others may read
        raise ConfigError(f"{path} sets {', '.join(secrets)} but is readable by others "
                          f"(mode {mode:o}): run `chmod 600 {path}`")
    return values


def _toml_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _relative_to(base: Path, value: Any) -> Any:
    if isinstance(value, Path):
        return value if value.is_absolute() else base / value
    if isinstance(value, tuple):
        return tuple(_relative_to(base, v) for v in value)
    return value


def from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings MLXD_* variables set. An empty variable is an unset one."""
    values = {}
    for s in SETTINGS:
        raw = environ.get(s.env, "")
        if not raw.strip():
            continue
        try:
            if s.kind.separator is None:
                values[s.name] = s.kind.parse(raw)
            else:
                values[s.name] = tuple(s.kind.parse(item) for item in raw.split(s.kind.separator)
                                       if item.strip())
        except ValueError:
            raise ConfigError(f"{s.env}={raw!r} is not {s.kind.what}") from None
    return values


@dataclass(frozen=True)
class Resolved:
    """The effective configuration and where each value came from: "default",
    "file PATH", "env MLXD_X" or "flag --x"."""
    config: Config
    sources: dict[str, str]
    file: Path          # the config file looked at
    file_read: bool     # False: the default file, absent


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
            config_file: Path | None = None) -> Resolved:
    """Flags (setting name → value; None: not given) over MLXD_* environment over the
    TOML file over the table's defaults. `config_file` (from --config) or MLXD_CONFIG names
    a file that must exist; otherwise the platform's default file is read if it exists."""
    explicit = config_file or (Path(environ["MLXD_CONFIG"]) if environ.get("MLXD_CONFIG")
                               else None)
    path = (explicit or default_config_path(environ)).expanduser()
    file_read = explicit is not None or path.is_file()
    layers = [("file", read_file(path) if file_read else {}),
              ("env", from_environ(environ)),
              ("flag", {k: v for k, v in flags.items() if v is not None})]
    values: dict[str, Any] = {}
    sources = {s.name: DEFAULT for s in SETTINGS}
    for origin, layer in layers:
        for name, value in layer.items():
            s = BY_NAME[name]
            values[name] = tuple(value) if isinstance(value, list) else value  # repeated flags
            sources[name] = {"file": f"file {path}", "env": f"env {s.env}",
                             "flag": f"flag {s.flag}"}[origin]
    state_dir = values.get("state_dir") or BY_NAME["state_dir"].default_value()
    values["state_dir"] = Path(state_dir).expanduser()
    if not values.get("log_dir"):
        values["log_dir"] = default_log_dir(values["state_dir"], sources["state_dir"] != DEFAULT)
    return Resolved(Config(**values), sources, path, file_read)
