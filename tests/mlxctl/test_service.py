"""`mlxctl service`: the rendered LaunchAgent and systemd unit, and exactly which
launchctl / systemctl commands run (the command runner is injected)."""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys

import pytest

from mlxctl.service import (LABEL, UNIT, Completed, Service, ServiceError, launchd_plist,
                           spec_for, systemd_quote)
from tests.serverproc import REPO


class Recorder:
    """A command runner that records argv and answers from a table (default: success)."""

    def __init__(self, answers: dict | None = None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv):
        self.calls.append(list(argv))
        return self.answers.get(tuple(argv[:2]), Completed(0, "ok\n"))


FLAGS = ["--model", "mlx-community/Qwen2.5-7B-Instruct-4bit", "--port", "9000",
         "--shutdown-timeout", "45"]


def test_spec_validates_flags_and_waits_longer_than_the_drain(tmp_path):
    spec = spec_for(FLAGS, environ={"PATH": "/usr/bin:/bin", "HF_HOME": "/hf", "SECRET": "x"},
                    python="/venv/bin/python", home=tmp_path, platform="darwin")
    assert spec.program == ["/venv/bin/python", "-m", "supervisor", *FLAGS]
    assert spec.exit_timeout_s > 45 + 2 * 5  # drain, then cancel grace, then worker stop
    assert spec.environment == {"PATH": "/usr/bin:/bin", "HF_HOME": "/hf", "PYTHONUNBUFFERED": "1"}
    assert spec.log_dir == tmp_path / "Library" / "Logs" / "mlxd"
    with pytest.raises(SystemExit):
        spec_for(["--port", "9000"], environ={})           # no model
    with pytest.raises(SystemExit):
        spec_for([*FLAGS, "--no-such-flag"], environ={})    # a typo fails now, not at boot
    from_env = spec_for([], environ={"MLXD_MODEL": "demo"}, python="py", home=tmp_path)
    assert from_env.program == ["py", "-m", "supervisor", "--model", "demo"]


def test_launch_agent_plist(tmp_path):
    spec = spec_for(FLAGS, environ={"PATH": "/usr/bin"}, python="/venv/bin/python",
                    home=tmp_path, platform="darwin")
    plist = plistlib.loads(launchd_plist(spec))
    assert plist["Label"] == LABEL
    assert plist["ProgramArguments"] == spec.program
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on crash only
    assert plist["AbandonProcessGroup"] is True
    assert plist["ExitTimeOut"] == spec.exit_timeout_s
    assert plist["ProcessType"] == "Interactive"
    logs = tmp_path / "Library" / "Logs" / "mlxd"
    assert plist["StandardOutPath"] == str(logs / "mlxd.stdout.log")
    assert plist["StandardErrorPath"] == str(logs / "mlxd.stderr.log")
    assert plist["EnvironmentVariables"] == {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1"}
    assert plist["WorkingDirectory"] == str(tmp_path)


def test_launchctl_commands(tmp_path):
    run = Recorder()
    svc = Service(platform="darwin", home=tmp_path, uid=501, run=run)
    spec = spec_for(FLAGS, environ={}, python="/py", home=tmp_path, platform="darwin")
    path = svc.install(spec)
    assert path == tmp_path / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    assert plistlib.loads(path.read_bytes())["ProgramArguments"] == spec.program
    assert run.calls == [["launchctl", "bootout", f"gui/501/{LABEL}"],
                         ["launchctl", "bootstrap", "gui/501", str(path)]]
    run.calls.clear()
    svc.start()  # loaded (print succeeds): kickstart
    assert run.calls == [["launchctl", "print", f"gui/501/{LABEL}"],
                         ["launchctl", "kickstart", f"gui/501/{LABEL}"]]
    run.calls.clear()
    svc.stop()
    assert run.calls == [["launchctl", "bootout", f"gui/501/{LABEL}"]]
    run.calls.clear()
    not_loaded = Recorder({("launchctl", "print"): Completed(113, "", "Could not find service")})
    Service(platform="darwin", home=tmp_path, uid=501, run=not_loaded).start()
    assert not_loaded.calls[-1] == ["launchctl", "bootstrap", "gui/501", str(path)]
    running, _ = svc.status()
    assert running and run.calls == [["launchctl", "print", f"gui/501/{LABEL}"]]
    run.calls.clear()
    svc.uninstall()
    assert run.calls == [["launchctl", "bootout", f"gui/501/{LABEL}"]] and not path.exists()
    with pytest.raises(ServiceError, match="not installed"):
        svc.start()


def test_systemd_unit_and_commands(tmp_path):
    run = Recorder()
    svc = Service(platform="linux", home=tmp_path, uid=1000, run=run)
    spec = spec_for([*FLAGS, "--state-dir", str(tmp_path / "my state")],
                    environ={"PATH": "/usr/bin"}, python="/venv/bin/python", home=tmp_path,
                    platform="linux")
    path = svc.install(spec)
    assert path == tmp_path / ".config" / "systemd" / "user" / UNIT
    unit = path.read_text()
    assert f'ExecStart=/venv/bin/python -m supervisor {" ".join(FLAGS)} --state-dir "{tmp_path}/my state"' in unit
    assert "Restart=on-failure" in unit and "KillMode=mixed" in unit
    assert f"TimeoutStopSec={spec.exit_timeout_s}" in unit
    assert "Environment=PATH=/usr/bin" in unit and "Environment=PYTHONUNBUFFERED=1" in unit
    assert f"StandardError=append:{tmp_path}/my state/logs/mlxd.stderr.log" in unit
    assert "$" not in unit  # every placeholder filled
    assert run.calls == [["systemctl", "--user", "daemon-reload"],
                         ["systemctl", "--user", "enable", "--now", UNIT]]
    run.calls.clear()
    svc.start(), svc.stop(), svc.status()
    assert run.calls == [["systemctl", "--user", "start", UNIT], ["systemctl", "--user", "stop", UNIT],
                         ["systemctl", "--user", "status", "--no-pager", UNIT]]
    run.calls.clear()
    svc.uninstall()
    assert run.calls == [["systemctl", "--user", "disable", "--now", UNIT],
                         ["systemctl", "--user", "daemon-reload"]]
    assert not path.exists()


def test_failed_commands_say_what_failed(tmp_path):
    run = Recorder({("systemctl", "--user"): Completed(1, "", "Failed to connect to bus")})
    svc = Service(platform="linux", home=tmp_path, run=run)
    with pytest.raises(ServiceError, match="Failed to connect to bus"):
        svc.install(spec_for(FLAGS, environ={}, home=tmp_path))
    assert svc.path.exists()  # the unit was written before systemctl was asked


@pytest.mark.parametrize("arg,quoted", [("plain", "plain"), ("a b", '"a b"'), ('x"y', '"x\\"y"'),
                                        ("50%", "50%%"), ("/p/a b%", '"/p/a b%%"')])
def test_systemd_quote(arg, quoted):
    assert systemd_quote(arg) == quoted


def test_systemd_path_for_real_as_far_as_the_files(tmp_path):
    """`mlxctl service install` as a process, with no systemctl on PATH: the unit file is
    written under $HOME, and the missing service manager is reported, not a traceback."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": str(tmp_path / "empty-bin"), "XDG_STATE_HOME": str(tmp_path / "st")}
    out = subprocess.run([sys.executable, "-m", "mlxctl.client", "service", "install",
                          "--model", "demo", "--port", "9123"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    if sys.platform == "darwin":
        pytest.skip("the launchd path is checked above with a recorded runner")
    unit = home / ".config" / "systemd" / "user" / UNIT
    assert unit.exists(), out.stderr
    assert f"ExecStart={systemd_quote(sys.executable)} -m supervisor --model demo --port 9123" in unit.read_text()
    assert out.returncode == 1 and "systemctl" in out.stderr and "Traceback" not in out.stderr
    status = subprocess.run([sys.executable, "-m", "mlxctl.client", "service", "status", "--json"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 1 and '"installed": true' in status.stdout
    assert os.path.exists(unit)
