"""POST /tokenize and /detokenize (vLLM's shape; llama-server offers the same pair), so a
client can budget its context with the model's own tokenizer and chat template.

/tokenize with `messages` counts exactly what a chat completion with the same body would
prefill (template, tools, reasoning switch: the worker renders it with the same code);
with `prompt`, what a completion would. Answered by the worker's preparation thread, so a
count does not wait for a decode slot (worker/tokens.py).
"""

from __future__ import annotations

from aiohttp import web

from supervisor.api.lifecycle import compute
from supervisor.api.parse.pooling import parse_detokenize_request, parse_tokenize_request
from supervisor.http.errors import read_json
from supervisor.keys import CONFIG, POOL


async def tokenize(request: web.Request) -> web.Response:
    parsed = parse_tokenize_request(await read_json(request), request.app[CONFIG])
    done = await compute(request, parsed.model, parsed.generate)
    ids = done.result.id_list()
    body = {"count": len(ids), "max_model_len": _context(request, done.model), "tokens": ids}
    if parsed.return_token_strs:
        body["token_strs"] = [p.decode("utf-8", "replace") for p in done.result.pieces]
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    parsed = parse_detokenize_request(await read_json(request))
    done = await compute(request, parsed.model, parsed.to_generate())
    return web.json_response({"prompt": done.result.text})


def _context(request: web.Request, model: str) -> int | None:
    runner = request.app[POOL].find(model)
    return runner.context_length if runner is not None else None


def setup(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
