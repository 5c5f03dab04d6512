"""`mlxctl service install|uninstall|start|stop|status`: mlxd as a background service.

macOS: a LaunchAgent rendered with plistlib from `launchd/com.mlxd.server.plist` into
~/Library/LaunchAgents/, driven with `launchctl bootstrap|bootout|kickstart|print
gui/$UID`. Linux: a systemd user unit from `launchd/mlxd.service` into
~/.config/systemd/user/, driven with `systemctl --user`. The commands go through an
injected runner, so tests check exactly what would run; rendering is pure.

Both wait long enough before killing (launchd ExitTimeOut, systemd TimeoutStopSec) for
the supervisor to drain (--shutdown-timeout) and stop its workers itself.
"""

from __future__ import annotations

import importlib.resources
import math
import os
import plistlib
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

LABEL = "com.mlxd.server"
UNIT = "mlxd.service"
TEMPLATES = importlib.resources.files("launchd")  # packaged with mlxd, see launchd/__init__.py
# Environment the service inherits from the installing shell, when set: where models
# and the HF cache are, and how mlxd finds its state.
PASSED_ENV = ("PATH", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "XDG_STATE_HOME",
              "XDG_CONFIG_HOME", "MLXD_STATE_DIR", "MLXD_CONFIG")


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str = ""
    stderr: str = ""


Runner = Callable[[list[str]], Completed]


def run_command(argv: list[str]) -> Completed:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return Completed(127, "", f"{argv[0]}: command not found")
    return Completed(out.returncode, out.stdout, out.stderr)


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs and how long it may take to stop."""
    program: list[str]                 # argv: python -m supervisor FLAGS
    log_dir: Path
    exit_timeout_s: int
    working_dir: Path
    environment: dict[str, str] = field(default_factory=dict)


def spec_for(flags: list[str], environ=os.environ, python: str = sys.executable,
             home: Path | None = None, platform: str = sys.platform) -> ServiceSpec:
    """Validate mlxd flags exactly as mlxd will (a typo fails now, not at every boot)."""
    from supervisor.cli import build_parser, config_from

    config = config_from(build_parser().parse_args(flags), environ)
    if not config.models:
        raise SystemExit("mlxctl service install: give the model to serve, e.g. "
                         "`mlxctl service install --model mlx-community/Qwen2.5-7B-Instruct-4bit`")
    home = home or Path.home()
    # Drain, then a cancel that may need its grace, then workers that may need theirs.
    exit_timeout = math.ceil(config.shutdown_timeout + 2 * config.cancel_grace + 10)
    env = {k: environ[k] for k in PASSED_ENV if environ.get(k)}
    env["PYTHONUNBUFFERED"] = "1"
    if "--model" not in flags:  # from MLXD_MODEL: the service must not depend on this shell
        flags = [*flags, *(arg for m in config.models for arg in ("--model", m))]
    log_dir = config.logs()
    if platform == "darwin" and "--log-dir" not in flags and "--state-dir" not in flags:
        log_dir = home / "Library" / "Logs" / "mlxd"
    return ServiceSpec([python, "-m", "supervisor", *flags], log_dir, exit_timeout, home, env)


def launchd_plist(spec: ServiceSpec, template=TEMPLATES / f"{LABEL}.plist") -> bytes:
    plist = plistlib.loads(template.read_bytes())
    plist["Label"] = LABEL
    plist["ProgramArguments"] = list(spec.program)
    plist["ExitTimeOut"] = spec.exit_timeout_s
    plist["WorkingDirectory"] = str(spec.working_dir)
    plist["StandardOutPath"] = str(spec.log_dir / "mlxd.stdout.log")
    plist["StandardErrorPath"] = str(spec.log_dir / "mlxd.stderr.log")
    plist["EnvironmentVariables"] = {**plist.get("EnvironmentVariables", {}), **spec.environment}
    return plistlib.dumps(plist)


def systemd_quote(arg: str) -> str:
    """One ExecStart word: systemd splits on blanks, honours double quotes and
    backslash escapes, and expands % specifiers."""
    arg = arg.replace("%", "%%")
    if arg and not any(c in arg for c in ' \t\n"\'\\;$'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(spec: ServiceSpec, template=TEMPLATES / UNIT) -> str:
    env = "\n".join(f"Environment={systemd_quote(f'{k}={v}')}"
                    for k, v in sorted(spec.environment.items()))
    return string.Template(template.read_text()).substitute(
        exec_start=" ".join(systemd_quote(a) for a in spec.program),
        working_dir=systemd_quote(str(spec.working_dir)),
        environment=env,
        timeout_stop=spec.exit_timeout_s,
        stdout_path=spec.log_dir / "mlxd.stdout.log",
        stderr_path=spec.log_dir / "mlxd.stderr.log",
    )


class ServiceError(Exception):
    """A service command failed; the message says which and why."""


class Service:
    def __init__(self, *, platform: str = sys.platform, home: Path | None = None,
                 uid: int | None = None, run: Runner = run_command):
        self.platform = platform
        self.home = home or Path.home()
        self.uid = os.getuid() if uid is None else uid
        self.run = run
        self.launchd = platform == "darwin"

    @property
    def path(self) -> Path:
        if self.launchd:
            return self.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return self.home / ".config" / "systemd" / "user" / UNIT

    @property
    def _domain(self) -> str:
        return f"gui/{self.uid}"

    @property
    def _target(self) -> str:
        return f"{self._domain}/{LABEL}"

    def _must(self, argv: list[str]) -> Completed:
        out = self.run(argv)
        if out.returncode != 0:
            raise ServiceError(f"`{' '.join(argv)}` failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()}")
        return out

    def _systemctl(self, *args: str) -> list[str]:
        return ["systemctl", "--user", *args]

    def install(self, spec: ServiceSpec) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        if self.launchd:
            self.path.write_bytes(launchd_plist(spec))
            self.run(["launchctl", "bootout", self._target])  # an older install: replace it
            self._must(["launchctl", "bootstrap", self._domain, str(self.path)])
        else:
            self.path.write_text(systemd_unit(spec))
            self._must(self._systemctl("daemon-reload"))
            self._must(self._systemctl("enable", "--now", UNIT))
        return self.path

    def uninstall(self) -> Path:
        if self.launchd:
            self.run(["launchctl", "bootout", self._target])  # fine if it was not loaded
        else:
            self.run(self._systemctl("disable", "--now", UNIT))
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        if not self.launchd:
            self.run(self._systemctl("daemon-reload"))
        return self.path

    def _require_installed(self) -> None:
        if not self.path.exists():
            raise ServiceError(f"mlxd is not installed as a service ({self.path} is missing); "
                               "run `mlxctl service install --model MODEL` first")

    def start(self) -> None:
        self._require_installed()
        if not self.launchd:
            self._must(self._systemctl("start", UNIT))
        elif self.run(["launchctl", "print", self._target]).returncode == 0:
            self._must(["launchctl", "kickstart", self._target])  # loaded: (re)start it
        else:
            self._must(["launchctl", "bootstrap", self._domain, str(self.path)])

    def stop(self) -> None:
        self._require_installed()
        if self.launchd:
            self._must(["launchctl", "bootout", self._target])
        else:
            self._must(self._systemctl("stop", UNIT))

    def status(self) -> tuple[bool, str]:
        """(running or loaded, the service manager's own report)."""
        if not self.path.exists():
            return False, f"not installed ({self.path} is missing)"
        if self.launchd:
            out = self.run(["launchctl", "print", self._target])
        else:
            out = self.run(self._systemctl("status", "--no-pager", UNIT))
        return out.returncode == 0, (out.stdout or out.stderr).strip()
