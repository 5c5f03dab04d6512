"""The resident models: API model id → ModelRunner.

A model's id in the API is the name it was given: `demo`, a Hugging Face repo id, or a
path exactly as given; for a path, its last component is accepted as an alias.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import zmq.asyncio

from supervisor.config import Config
from supervisor.errors import APIError
from supervisor.link import LinkFactory, ProcessLink
from supervisor.runner import READY, ModelRunner


def worker_args(config: Config) -> list[str]:
    """Flags every worker gets from the server's configuration."""
    args = ["--state-dir", str(config.state_dir), "--prefill-step", str(config.prefill_step),
            "--heartbeat-interval", str(config.heartbeat_interval),
            "--stream-interval", str(config.stream_interval)]
    if config.max_context_tokens:
        args += ["--max-context-tokens", str(config.max_context_tokens)]
    if config.log_prompts:
        args.append("--log-prompts")
    return args


def process_link_factory(config: Config, model: str, runtime_dir: Path,
                         ctx: zmq.asyncio.Context) -> LinkFactory:
    def make(epoch: int) -> ProcessLink:
        return ProcessLink(epoch=epoch, model=model, name=model, runtime_dir=runtime_dir,
                           ctx=ctx, worker_args=worker_args(config), python=sys.executable)
    return make


def aliases(model: str) -> list[str]:
    """Other names a model answers to: a path's last component."""
    if model != "demo" and (os.sep in model or model.startswith(".")) and Path(model).exists():
        base = Path(model.rstrip(os.sep)).name
        return [base] if base and base != model else []
    return []


class Pool:
    def __init__(self, config: Config, factory_for):
        """`factory_for(model) -> LinkFactory`: how a model's workers are made."""
        self.config = config
        self._factory_for = factory_for
        self.runners: dict[str, ModelRunner] = {}
        self._aliases: dict[str, str] = {}
        self.created: dict[str, int] = {}  # for /v1/models

    def add(self, model: str) -> ModelRunner:
        runner = ModelRunner(model, self.config, self._factory_for(model))
        self.runners[model] = runner
        for a in aliases(model):
            self._aliases.setdefault(a, model)
        self.created[model] = int(time.time())
        runner.start()
        return runner

    def get(self, name: str) -> ModelRunner:
        runner = self.runners.get(name) or self.runners.get(self._aliases.get(name, ""))
        if runner is None:
            raise APIError.model_not_found(name)
        return runner

    def begin_shutdown(self) -> None:
        for r in self.runners.values():
            r.begin_shutdown()

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.runners.values()))

    def health(self) -> tuple[int, dict]:
        """(status, body): 200 while a worker is ready, 503 with a reason otherwise."""
        workers = [r.snapshot() for r in self.runners.values()]
        ready = [w for w in workers if w["state"] == READY]
        if not workers:
            return 503, {"status": "unavailable", "reason": "no model configured", "workers": []}
        if ready:
            status = "ok" if len(ready) == len(workers) else "degraded"
            reasons = [f"{w['model']}: {w['state']}" for w in workers if w["state"] != READY]
            body = {"status": status, "workers": workers}
            if reasons:
                body["reason"] = "; ".join(reasons)
            return 200, body
        reasons = []
        for w in workers:
            why = f"model {w['model']} is {w['state']}"
            if w["last_error"]:
                why += f": {w['last_error']}"
            reasons.append(why)
        return 503, {"status": "unavailable", "reason": "; ".join(reasons), "workers": workers}
