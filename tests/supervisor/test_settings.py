"""One table of settings: the supervisor's Config, its flags and MLXD_* names, and the
worker's flags all come from protocol/settings.py, with one default per setting."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from protocol.settings import (BY_NAME, SETTINGS, WORKER_SETTINGS, format_size, size,
                               worker_argv, worker_parser)
from supervisor.cli import build_parser
from supervisor.config import Config

# What supervisor/workers/link.py adds to worker_argv for one process.
PROCESS = ["--model", "demo", "--commands", "ipc://c", "--events", "ipc://e", "--epoch", "3"]


def test_config_has_exactly_the_table_with_its_defaults():
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert list(fields) == [s.name for s in SETTINGS]
    config = Config()
    for s in SETTINGS:
        assert getattr(config, s.name) == s.default_value(), s.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1


def test_every_setting_has_a_flag_and_an_environment_name():
    actions = {a.dest: a for a in build_parser()._actions}
    for s in SETTINGS:
        assert s.flag in actions[s.name].option_strings, s.name
        assert s.env == "MLXD_" + s.flag[2:].replace("-", "_").upper()
    # The names users already have in their scripts and services.
    assert (BY_NAME["models"].env, BY_NAME["models_dirs"].env) == ("MLXD_MODEL", "MLXD_MODELS_DIR")
    assert BY_NAME["queue_timeout"].flag == "--queue-timeout"


def test_the_worker_takes_the_settings_it_always_took():
    assert {s.name for s in WORKER_SETTINGS} == {
        "state_dir", "max_context_tokens", "prefill_step", "heartbeat_interval",
        "stream_interval", "buffer_cache_idle", "log_prompts", "kv_budget", "max_batch_size",
        "prefill_batch_size", "prompt_cache_bytes", "prompt_cache_ttl", "kv_disk_bytes", "warm_prompt",
        "max_kv_size",
        "kv_bits", "kv_group_size", "quantized_kv_start", "gguf_dtype", "quantize",
        # a worker group's ranks: how to shard, the per-host memory check's factor, and how
        # long the leader waits for the other ranks to join
        "sharding", "memory_factor", "group_join_timeout",
        # speculative decoding (worker/speculative/)
        "speculative", "max_draft_tokens", "draft_model"}


def worker_values(argv: list[str], parser: argparse.ArgumentParser | None = None) -> dict:
    args = (parser or worker_parser()).parse_args([*PROCESS, *argv])
    return {s.name: getattr(args, s.name) for s in WORKER_SETTINGS}


@pytest.mark.parametrize("changes", [
    {},
    {"state_dir": Path("/tmp/s p a c e"), "max_context_tokens": 2048, "prefill_step": 64,
     "heartbeat_interval": 0.25, "stream_interval": 0.0, "log_prompts": True},
    {"stream_interval": 1 / 3, "max_context_tokens": 0, "heartbeat_interval": 2,
     "buffer_cache_idle": 0.0},
])
def test_worker_argv_round_trips_through_the_worker_parser(changes):
    config = Config(**changes)
    got = worker_values(worker_argv(config))
    assert got == {s.name: getattr(config, s.name) for s in WORKER_SETTINGS}


def test_every_worker_default_is_the_supervisors_default():
    """One default per setting: a worker started with no setting flags (as tests and
    tools start it) runs with what the server would have given it."""
    assert worker_values([]) == {s.name: getattr(Config(), s.name) for s in WORKER_SETTINGS}


def test_the_worker_process_parses_with_the_shared_parser():
    """The worker's own `parse_args` is the table's parser: same names, same defaults."""
    from worker.__main__ import parse_args

    defaults = {s.name: getattr(Config(), s.name) for s in WORKER_SETTINGS}
    args = parse_args(PROCESS)
    assert {s.name: getattr(args, s.name) for s in WORKER_SETTINGS} == defaults
    config = Config(stream_interval=0.5, log_prompts=True, prefill_step=7)
    args = parse_args([*PROCESS, *worker_argv(config)])
    assert (args.stream_interval, args.log_prompts, args.prefill_step) == (0.5, True, 7)


def test_worker_args_of_the_pool_are_the_tables():
    from supervisor.workers.launch import worker_args

    config = Config(max_context_tokens=100, log_prompts=True)
    argv = worker_args(config)
    assert argv[argv.index("--max-context-tokens") + 1] == "100" and "--log-prompts" in argv
    assert argv[argv.index("--stream-interval") + 1] == "0.01"


@pytest.mark.parametrize("text,n", [("2G", 2 << 30), ("512MiB", 512 << 20), ("1.5g", 3 << 29),
                                    ("100", 100), (" 4 kb ", 4096)])
def test_sizes(text, n):
    assert size(text) == n
    assert size(format_size(n)) == n


@pytest.mark.parametrize("text", ["", "G", "lots", "-1G", "2X", "nan", "inf"])
def test_not_sizes(text):
    with pytest.raises(ValueError):
        size(text)
