"""Requests that compute one result instead of streaming tokens: tokenize, detokenize,
embeddings, rerank scores (protocol Task).

They travel as a Generate with a `task`, so they share everything a generation has:
admission and --max-queue, the queue and request timeouts, cancel when the client leaves,
re-queueing when a worker dies before starting them, exactly one Done. The worker sends
the result (Tokens or Pooled) just before that Done; `compute` waits for both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from protocol import Done, Generate, Pooled, Tokens
from supervisor.api.generation import log_request, submit
from supervisor.workers.errors import Internal


@dataclass(frozen=True)
class Computed:
    model: str                 # the served model's id
    result: Tokens | Pooled
    done: Done                 # its usage: prompt_tokens


async def compute(request: web.Request, model_name: str, message: Generate,
                  params: dict | None = None) -> Computed:
    """Run `message` (its task set, its rid not) on `model_name`'s worker. Raises the
    domain error that ended it, like a generation does (api/stream.py). A Pooled result
    has one row per input, checked here."""
    rows = len(message.inputs or message.input_ids or ())
    runner, gen = await submit(request, model_name, message, params)
    t0 = time.monotonic()
    try:
        await gen.started()
        async for _ in gen.parts():
            pass  # a task sends no Deltas; this waits for its Done (or its failure)
        result = gen.handle.result
        if result is None or (isinstance(result, Pooled) and result.rows != rows):
            raise Internal()  # a worker that ends a task without its result: our bug
        return Computed(runner.id, result, gen.done)
    finally:
        gen.close()
        log_request(request, gen, runner.id, False, t0)
