"""GET /v1/models and /v1/models/{id}: the loaded models and the local MLX models.

Loaded models carry their runner's state and context length; models on this machine that
are not loaded (the Hugging Face cache, `demo` once built) are listed with state
`not_loaded`, so a client can pick one and load-on-request does the rest. The disk scan
runs in a thread and is cached for a few seconds: clients poll this endpoint.
`/v1/models/{id}` answers for what a request could load (inside the model roots) and
nothing else, with the same 404 for everything it does not serve: asking must not be a
way to probe the disk. A request with `anthropic-version` (every Anthropic client sends
it) gets Anthropic's Models API shape instead, with each model's window
(api/messages/models.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterable

from aiohttp import web

from supervisor.api.audio import voices
from supervisor.api.messages import models as anthropic
from supervisor.memory import catalog
from supervisor.memory.catalog import LocalModel
from supervisor.config import Config
from supervisor.http.errors import APIError
from supervisor.keys import POOL
from supervisor.workers.pool import Pool
from supervisor.workers.runner import ModelRunner

NOT_LOADED = "not_loaded"

# What each kind of model serves, as /v1/models says it (`capabilities`): the routes.
CAPABILITIES = {
    "text": ("chat.completions", "completions", "responses", "messages", "tokenize"),
    "vision": ("chat.completions", "completions", "responses", "messages", "tokenize",
               "vision"),
    "embed": ("embeddings", "tokenize"),
    "rerank": ("rerank", "tokenize"),
    "stt": ("audio.transcriptions",),
    "tts": ("audio.speech",),
}


def capabilities(kind: str | None, translates: bool = False,
                 hears_audio: bool = False) -> list[str]:
    found = list(CAPABILITIES.get(kind or "", ()))
    return (found + (["audio.translations"] if translates else [])
            + (["audio"] if hears_audio else []))


class LocalModels:
    TTL_S = 10.0

    def __init__(self, config: Config):
        self.config = config
        self._at = -1e9
        self._models: list[LocalModel] = []
        self._lock = asyncio.Lock()

    async def all(self) -> list[LocalModel]:
        async with self._lock:
            if time.monotonic() - self._at > self.TTL_S:
                self._models = await asyncio.to_thread(
                    catalog.scan, self.config.state_dir, self.config.max_context_tokens)
                self._at = time.monotonic()
            return self._models

    def forget(self) -> None:
        """The disk changed (a model was deleted): scan again on the next listing."""
        self._at = -1e9

    async def one(self, name: str, *, anywhere: bool = False) -> LocalModel | None:
        """`name` if it is a model a request may load; `anywhere`: any local model (the
        admin's view)."""
        return await asyncio.to_thread(self._one, name, anywhere)

    def _one(self, name: str, anywhere: bool) -> LocalModel | None:
        state_dir = self.config.state_dir
        if not anywhere:
            roots = catalog.model_roots(state_dir, self.config.models_dirs)
            if catalog.request_target(name, state_dir, roots) is None:
                return None
        return catalog.describe(name, state_dir, self.config.max_context_tokens)


LOCAL_MODELS = web.AppKey("local_models", LocalModels)


def loaded_object(pool: Pool, runner: ModelRunner) -> dict:
    extra = {"dimensions": runner.dimensions} if runner.dimensions else {}
    if runner.voices:  # and what OpenAI's voice names stand for on this model
        extra["voices"] = runner.voices
        extra["voice_aliases"] = voices.aliases(runner.voices)
    return model_object(runner.id, pool.created.get(runner.id, 0), "mlxd",
                               state=runner.state, context_length=runner.context_length,
                               random_weights=runner.random_weights, kind=runner.kind,
                               capabilities=capabilities(runner.kind, runner.translates,
                                                         runner.hears_audio),
                               **extra)


def local_object(model: LocalModel) -> dict:
    return model_object(model.id, model.modified, "mlxd", state=NOT_LOADED,
                               context_length=model.context_length, size_bytes=model.size_bytes,
                               kind=model.kind, capabilities=capabilities(model.kind))


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    data = [loaded_object(pool, r) for r in pool.runners.values()]
    data += [local_object(m) for m in await request.app[LOCAL_MODELS].all()
             if pool.find(m.id) is None]
    if anthropic.wanted(request):
        return web.json_response(anthropic.page(data, request.query))
    return web.json_response(model_list(data))


async def get_model(request: web.Request) -> web.Response:
    """Never loads: asking about a model is not using it."""
    pool, name = request.app[POOL], request.match_info["model"]
    runner = pool.find(name)
    if runner is None:  # another spelling of a loaded model?
        found = await asyncio.to_thread(catalog.target, name, pool.config.state_dir)
        runner = pool.at(found.real) if found is not None else None
    if runner is not None:
        entry = loaded_object(pool, runner)
    else:
        local = await request.app[LOCAL_MODELS].one(name)
        if local is None:
            raise APIError.model_not_found(name)
        entry = local_object(local)
    return web.json_response(anthropic.one(entry) if anthropic.wanted(request) else entry)


def setup(app: web.Application, config: Config) -> None:
    app[LOCAL_MODELS] = LocalModels(config)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)


def model_object(id: str, created: int, owned_by: str = "mlxd", **extra) -> dict:
    """An entry of /v1/models. Extra keys (e.g. context_length, state) ride along; clients
    ignore what they do not know."""
    return {"id": id, "object": "model", "created": created, "owned_by": owned_by, **extra}


def model_list(models: Iterable[dict]) -> dict:
    return {"object": "list", "data": list(models)}
