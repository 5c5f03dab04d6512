"""Flags over MLXD_* environment over defaults; the state dir holds everything."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli import build_parser, config_from
from supervisor.config import Config, default_state_dir


def cfg(argv, env=None) -> Config:
    return config_from(build_parser().parse_args(argv), env or {})


def test_defaults():
    c = cfg([])
    assert (c.host, c.port, c.models) == ("127.0.0.1", 8080, ())
    assert c.state_dir == default_state_dir() and not c.log_prompts


def test_environment_then_flags(tmp_path):
    env = {"MLXD_PORT": "9001", "MLXD_MODEL": "demo, /m/x", "MLXD_LOG_PROMPTS": "1",
           "MLXD_QUEUE_TIMEOUT": "2.5", "MLXD_STATE_DIR": str(tmp_path)}
    c = cfg([], env)
    assert c.port == 9001 and c.models == ("demo", "/m/x") and c.log_prompts
    assert c.queue_timeout == 2.5 and c.state_dir == tmp_path
    assert c.logs() == tmp_path / "logs"  # an explicit state dir keeps logs inside it
    c = cfg(["--port", "9002", "--model", "a", "--model", "b"], env)
    assert c.port == 9002 and c.models == ("a", "b")


def test_bad_environment_value_is_a_clear_exit():
    with pytest.raises(SystemExit) as e:
        cfg([], {"MLXD_PORT": "eighty"})
    assert "MLXD_PORT" in str(e.value)


def test_every_option_maps_to_a_config_field():
    from dataclasses import fields

    from supervisor.cli import OPTIONS
    names = {f.name for f in fields(Config)}
    assert {name for _, name, _, _ in OPTIONS} <= names


def test_default_state_dir_by_platform(monkeypatch, tmp_path):
    import supervisor.config as config
    monkeypatch.setattr(config.sys, "platform", "darwin")
    assert default_state_dir() == Path.home() / "Library" / "Application Support" / "mlxd"
    monkeypatch.setattr(config.sys, "platform", "linux")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / "mlxd"


def test_models_dirs_from_flags_or_environment(tmp_path):
    import os

    env = {"MLXD_MODELS_DIR": os.pathsep.join([str(tmp_path / "a"), "", "~/b "])}
    assert cfg([], env).models_dirs == (tmp_path / "a", Path.home() / "b")
    c = cfg(["--models-dir", str(tmp_path / "x"), "--models-dir", "~/y"], env)  # flags win
    assert c.models_dirs == (tmp_path / "x", Path.home() / "y")
    assert cfg([]).models_dirs == ()
