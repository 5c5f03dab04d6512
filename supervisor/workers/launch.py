"""How the server starts a model's workers: the flags they get from its configuration,
the link factory that spawns `python -m worker` for each incarnation (pool.py's runners
take it), and how many ranks of a worker group run on this machine (the memory gate
counts those)."""

from __future__ import annotations

import sys
from pathlib import Path

import zmq.asyncio

from protocol.hosts import local_share, read_hostfile
from protocol.settings import worker_argv
from supervisor.config import Config
from supervisor.workers.link import LinkFactory, ProcessLink


def worker_args(config: Config, model: str | None = None) -> list[str]:
    """Flags `model`'s workers get from the server's configuration: the worker settings of
    the one table (protocol/settings.py), which the worker's parser reads back, with the
    model's own --model-setting values."""
    return worker_argv(config, model)


def process_link_factory(config: Config, model: str, runtime_dir: Path,
                         ctx: zmq.asyncio.Context) -> LinkFactory:
    # `--hosts`: the models named by --model are each served by a worker group.
    hosts = config.hosts if config.hosts is not None and model in config.models else None

    def make(epoch: int) -> ProcessLink:
        return ProcessLink(epoch=epoch, model=model, name=model, runtime_dir=runtime_dir,
                           ctx=ctx, worker_args=worker_args(config, model), python=sys.executable,
                           hosts=hosts, state_dir=config.state_dir)
    return make


def group_share(config: Config, model: str) -> tuple[int, int]:
    """(ranks on this machine, ranks in all) of the worker group serving `model`: (1, 1)
    for a model served by one process (`--hosts` serves the --model models)."""
    if config.hosts is None or model not in config.models:
        return 1, 1
    return local_share(read_hostfile(config.hosts))
