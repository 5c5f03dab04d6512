"""Flags over MLXD_* environment over the TOML file over defaults; the state dir holds
everything; a bad configuration is one clear line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import build_parser, config_from, resolved_from
from supervisor.config import Config, ConfigError, default_config_path, default_state_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch, tmp_path_factory):
    """The developer's own ~/.config/mlxd/config.toml must not leak into these tests."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "MLXD_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def cfg(argv, env=None) -> Config:
    return config_from(build_parser().parse_args(argv), env or {})


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


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
    with pytest.raises(ConfigError, match="MLXD_LOG_PROMPTS='maybe' is not true or false"):
        cfg([], {"MLXD_LOG_PROMPTS": "maybe"})  # not silently off


@pytest.mark.parametrize("argv,message", [
    (["--port", "x"], "argument --port: not a port number (0 to 65535): 'x'"),
    (["--port", "70000"], "argument --port: not a port number (0 to 65535): '70000'"),
    (["--kv-budget", "2Q"], "argument --kv-budget: not a size"),
    (["--log-level", "loud"], "argument --log-level: not one of debug, info, warning, error"),
])
def test_a_bad_flag_is_argparses_error_naming_flag_and_type(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_default_state_dir_by_platform(monkeypatch, tmp_path):
    import supervisor.config as config
    monkeypatch.setattr(config.sys, "platform", "darwin")
    assert default_state_dir() == Path.home() / "Library" / "Application Support" / "mlxd"
    monkeypatch.setattr(config.sys, "platform", "linux")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / "mlxd"


def test_default_config_path_by_platform(monkeypatch, tmp_path):
    import supervisor.config as config
    monkeypatch.setattr(config.sys, "platform", "darwin")
    assert default_config_path({}) == (Path.home() / "Library" / "Application Support" / "mlxd"
                                       / "config.toml")
    monkeypatch.setattr(config.sys, "platform", "linux")
    assert default_config_path({}) == Path.home() / ".config" / "mlxd" / "config.toml"
    assert default_config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "mlxd" / "config.toml"


def test_models_dirs_from_flags_or_environment(tmp_path):
    env = {"MLXD_MODELS_DIR": os.pathsep.join([str(tmp_path / "a"), "", "~/b "])}
    assert cfg([], env).models_dirs == (tmp_path / "a", Path.home() / "b")
    c = cfg(["--models-dir", str(tmp_path / "x"), "--models-dir", "~/y"], env)  # flags win
    assert c.models_dirs == (tmp_path / "x", Path.home() / "y")
    assert cfg([]).models_dirs == ()


# ---- the TOML file and precedence --------------------------------------------------------

FILE = """
models = ["from-file", "other"]
port = 7000
queue_timeout = 30
kv_budget = "2G"
log_prompts = true
state_dir = "state"
models_dirs = ["~/m", "/abs/m"]
max_body_bytes = 1024
"""

# (setting, file's value, MLXD_* value, flag, its value, expected from env, expected from flag)
LAYERS = [
    ("port", 7000, "7001", "--port", "7002", 7001, 7002),                    # int
    ("queue_timeout", 30.0, "31.5", "--queue-timeout", "32", 31.5, 32.0),    # float
    ("kv_budget", 2 << 30, "3G", "--kv-budget", "512M", 3 << 30, 512 << 20),  # size
    ("models", ("from-file", "other"), "env-a,env-b", "--model", "flag-a",   # the models list
     ("env-a", "env-b"), ("flag-a",)),
]


@pytest.mark.parametrize("name,from_file,env_value,flag,flag_value,from_env,from_flag", LAYERS)
def test_flag_over_env_over_file_over_default(tmp_path, name, from_file, env_value, flag,
                                              flag_value, from_env, from_flag):
    path = write(tmp_path / "mlxd.toml", FILE)
    default = getattr(Config(), name)
    env_name = "MLXD_MODEL" if name == "models" else f"MLXD_{name.upper()}"
    assert default != from_file
    assert getattr(cfg([]), name) == default
    assert getattr(cfg(["--config", str(path)]), name) == from_file
    assert getattr(cfg(["--config", str(path)], {env_name: env_value}), name) == from_env
    assert getattr(cfg(["--config", str(path), flag, flag_value], {env_name: env_value}),
                   name) == from_flag


def test_bool_and_path_layers(tmp_path):
    path = write(tmp_path / "mlxd.toml", FILE)
    c = cfg(["--config", str(path)])
    assert c.log_prompts is True                            # bool from the file
    assert c.state_dir == tmp_path / "state"                # relative to the file
    assert c.logs() == tmp_path / "state" / "logs"          # a file's state dir is explicit
    assert c.models_dirs == (Path.home() / "m", Path("/abs/m"))
    env = {"MLXD_LOG_PROMPTS": "off", "MLXD_STATE_DIR": str(tmp_path / "env")}
    c = cfg(["--config", str(path)], env)
    assert c.log_prompts is False and c.state_dir == tmp_path / "env"
    c = cfg(["--config", str(path), "--log-prompts", "--state-dir", "~/flag"], env)
    assert c.log_prompts is True and c.state_dir == Path.home() / "flag"
    # A switch the file turned on can be turned off by a flag.
    assert cfg(["--config", str(path), "--no-log-prompts"]).log_prompts is False


def test_sources_name_where_each_value_came_from(tmp_path):
    path = write(tmp_path / "mlxd.toml", FILE)
    args = build_parser().parse_args(["--config", str(path), "--port", "1"])
    r = resolved_from(args, {"MLXD_QUEUE_TIMEOUT": "2", "MLXD_MODEL": "x"})
    assert r.sources["port"] == "flag --port"
    assert r.sources["queue_timeout"] == "env MLXD_QUEUE_TIMEOUT"
    assert r.sources["models"] == "env MLXD_MODEL"
    assert r.sources["kv_budget"] == f"file {path}"
    assert r.sources["host"] == "default" and r.config.host == "127.0.0.1"


def test_the_default_file_is_read_when_present_and_fine_when_absent(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert cfg([], env).port == 8080                       # no file: no error
    (tmp_path / "mlxd").mkdir()
    write(tmp_path / "mlxd" / "config.toml", "port = 9999\n")
    assert cfg([], env).port == 9999
    other = write(tmp_path / "other.toml", "port = 1234\n")
    assert cfg([], {**env, "MLXD_CONFIG": str(other)}).port == 1234   # MLXD_CONFIG names one
    assert cfg(["--config", str(other)], env).port == 1234


def test_a_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        cfg(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="config file not found"):
        cfg([], {"MLXD_CONFIG": str(tmp_path / "nope.toml")})


def test_an_unknown_key_is_an_error_naming_it(tmp_path):
    path = write(tmp_path / "c.toml", "port = 1\nqueue_timout = 5\n")
    with pytest.raises(ConfigError) as e:
        cfg(["--config", str(path)])
    assert e.value.message == (f"{path}: unknown setting 'queue_timout' "
                               "(did you mean 'queue_timeout'?)")
    path = write(tmp_path / "c.toml", "[server]\nport = 1\n")  # no tables: flat keys only
    with pytest.raises(ConfigError, match="unknown setting 'server'"):
        cfg(["--config", str(path)])


@pytest.mark.parametrize("line,message", [
    ('port = "80"', "port must be a port number (0 to 65535), not '80'"),
    ("port = 8.5", "port must be a port number (0 to 65535), not 8.5"),
    ("port = true", "port must be a port number (0 to 65535), not True"),  # no int here
    ("port = -1", "port must be a port number (0 to 65535), not -1"),
    ("port = 70000", "port must be a port number (0 to 65535), not 70000"),
    (f"port = {2**70}", f"port must be a port number (0 to 65535), not {2**70}"),
    ("queue_timeout = 1e400", "queue_timeout must be a number >= 0, not inf"),
    ("queue_timeout = nan", "queue_timeout must be a number >= 0, not nan"),
    ('kv_budget = "lots"', "kv_budget must be a size"),
    ('log_prompts = "yes"', "log_prompts must be true or false, not 'yes'"),
    ('models = "demo"', "models must be a list of strings, not 'demo'"),
    ("models = [1, 2]", "models must be a list of strings, not [1, 2]"),
    ("state_dir = 3", "state_dir must be a path (a string), not 3"),
    ('log_level = "loud"', "log_level must be one of debug, info, warning, error, not 'loud'"),
])
def test_a_wrong_type_is_an_error_naming_key_and_type(tmp_path, line, message):
    path = write(tmp_path / "c.toml", line + "\n")
    with pytest.raises(ConfigError) as e:
        cfg(["--config", str(path)])
    assert e.value.message.startswith(f"{path}: {message}")


def test_a_file_that_sets_an_api_key_must_be_private(tmp_path):
    """As --api-key-file refuses a key file others may read, so the config file that
    holds `api_key` itself."""
    path = write(tmp_path / "c.toml", 'api_key = ["sk-local"]\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError) as e:
        cfg(["--config", str(path)])
    assert e.value.message == (f"{path} sets api_key but is readable by others (mode 644): "
                               f"run `chmod 600 {path}`")
    path.chmod(0o600)
    assert cfg(["--config", str(path)]).api_key == ("sk-local",)
    public = write(tmp_path / "p.toml", "port = 9000\n")  # no secret: its mode is free
    public.chmod(0o644)
    assert cfg(["--config", str(public)]).port == 9000


def test_invalid_toml_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path / "c.toml", "port = \n")
    with pytest.raises(ConfigError, match=r"c\.toml: not valid TOML: .*line 1"):
        cfg(["--config", str(path)])


# ---- `mlxd` as a process: --print-config, and what a bad configuration looks like --------

def mlxd(*argv: str, env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLXD_", "XDG_"))}
    return subprocess.run([sys.executable, "-m", "supervisor", *argv], cwd=REPO,
                          env={**clean, "HOME": str(home), **env}, capture_output=True,
                          text=True, timeout=60)


def test_print_config_names_the_source_of_every_value(tmp_path):
    path = write(tmp_path / "mlxd.toml", 'models = ["from-file"]\nport = 7000\n'
                                        'queue_timeout = 30\nkv_budget = "2G"\n')
    env = {"MLXD_QUEUE_TIMEOUT": "12.5", "MLXD_LOG_PROMPTS": "yes"}
    out = mlxd("--config", str(path), "--port", "7100", "--print-config", env=env, home=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.stdout.splitlines()[1:]}
    assert out.stdout.splitlines()[0] == f"config file: {path}"
    assert rows["port"].split() == ["7100", "flag", "--port"]
    assert rows["queue_timeout"].split() == ["12.5", "env", "MLXD_QUEUE_TIMEOUT"]
    assert rows["log_prompts"].split() == ["true", "env", "MLXD_LOG_PROMPTS"]
    assert rows["kv_budget"].split() == ["2G", "file", str(path)]
    assert rows["models"].split() == ["from-file", "file", str(path)]
    assert rows["host"].split() == ["127.0.0.1", "default"]
    from protocol.settings import SETTINGS
    assert set(rows) == {"setting"} | {s.name for s in SETTINGS}  # every setting, once
    assert not (tmp_path / ".local").exists()  # printing starts nothing, writes nothing

    out = mlxd("--config", str(path), "--print-config", "json", env=env, home=tmp_path)
    settings = json.loads(out.stdout)["settings"]
    assert settings["kv_budget"] == {"value": 2 << 30, "source": f"file {path}"}
    assert settings["queue_timeout"] == {"value": 12.5, "source": "env MLXD_QUEUE_TIMEOUT"}
    assert settings["port"] == {"value": 7000, "source": f"file {path}"}


@pytest.mark.parametrize("config,argv,env,words", [
    ("port = 1\nqueue_timout = 5\n", [], {}, ["unknown setting 'queue_timout'", "queue_timeout"]),
    ("port = 'x'\n", [], {}, ["port must be a port number"]),
    ("port = 70000\n", [], {}, ["port must be a port number (0 to 65535), not 70000"]),
    (None, ["--config", "/nonexistent/mlxd.toml"], {}, ["config file not found"]),
    ("", [], {"MLXD_PORT": "eighty"}, ["MLXD_PORT='eighty'"]),
    ("", [], {}, ["no model given"]),
])
def test_a_bad_configuration_is_one_line_and_status_2(tmp_path, config, argv, env, words):
    if config is not None:
        argv = ["--config", str(write(tmp_path / "c.toml", config)), *argv]
    out = mlxd(*argv, env=env, home=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("mlxd: ")
    assert all(w in out.stderr for w in words), out.stderr


def test_a_model_has_its_own_kv_settings_from_file_env_or_flag(tmp_path):
    """--model-setting / [model_settings."MODEL"]: that model's workers get its KV format,
    every other model the server's (protocol/settings.py PER_MODEL)."""
    from protocol.settings import worker_argv, worker_parser

    def kv(config, model):
        args = worker_parser().parse_args(["--model", model, "--commands", "c", "--events", "e",
                                           "--epoch", "1", *worker_argv(config, model)])
        return args.kv_bits, args.kv_group_size

    path = write(tmp_path / "c.toml", 'kv_bits = 4\nmodels = ["demo", "ollama:qwen:7b"]\n'
                 '[model_settings."demo"]\nkv_bits = 8\nkv-group-size = 32\n'
                 '[model_settings."ollama:qwen:7b"]\nkv_group_size = 128\n')
    c = cfg(["--config", str(path)])
    assert c.model_settings == ("demo:kv_bits=8", "demo:kv_group_size=32",
                                "ollama:qwen:7b:kv_group_size=128")
    assert kv(c, "demo") == (8, 32) and kv(c, "ollama:qwen:7b") == (4, 128)
    assert kv(c, "other") == (4, 64)
    c = cfg(["--config", str(path)], {"MLXD_MODEL_SETTING": "other:kv-bits=8, demo:kv_bits=4"})
    assert kv(c, "other") == (8, 64) and kv(c, "demo") == (4, 64)
    c = cfg(["--model-setting", "demo:kv_bits=8", "--model-setting", "demo:kv_bits=4"])
    assert kv(c, "demo") == (4, 64) and kv(c, "x") == (None, 64)  # the last one wins
    c = cfg(["--model-setting", "demo:quantized_kv_start=512"])
    def start(model):
        argv = worker_argv(c, model)
        return argv[argv.index("--quantized-kv-start") + 1]

    assert (start("demo"), start("x")) == ("512", "0")


@pytest.mark.parametrize("toml,argv,message", [
    ('[model_settings."demo"]\nport = 1\n', None, "model_settings must be a list of "
     "MODEL:SETTING=VALUE, or a table of tables"),
    ('[model_settings."demo"]\nkv_bits = "8"\n', None, "model_settings must be"),
    ('model_settings = ["demo=8"]\n', None, "model_settings must be"),
    (None, ["--model-setting", "demo:kv_bits=eight"], "argument --model-setting: not a "
     "list of MODEL:SETTING=VALUE"),
    (None, ["--model-setting", "demo:max_batch_size=2"], "(settings: kv_bits, "
     "kv_group_size, quantized_kv_start, draft_model): 'demo:max_batch_size=2'"),
])
def test_a_bad_model_setting_is_a_clear_error(tmp_path, capsys, toml, argv, message):
    if toml is not None:
        path = write(tmp_path / "c.toml", toml)
        with pytest.raises(ConfigError) as e:
            cfg(["--config", str(path)])
        assert e.value.message.startswith(f"{path}: {message}")
        return
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err



def test_a_model_has_its_own_draft_model(tmp_path):
    """[model_settings."MODEL"] draft_model: that model's workers draft with it, the
    others with the server's (none here)."""
    from protocol.settings import worker_argv, worker_parser

    def draft(config, model):
        return worker_parser().parse_args(["--model", model, "--commands", "c", "--events",
                                           "e", "--epoch", "1",
                                           *worker_argv(config, model)]).draft_model

    path = write(tmp_path / "c.toml", 'models = ["demo", "other"]\n'
                 '[model_settings."demo"]\ndraft_model = "/models/demo-q4"\n')
    c = cfg(["--config", str(path)])
    assert draft(c, "demo") == "/models/demo-q4" and draft(c, "other") is None
