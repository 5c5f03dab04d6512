"""POST /tokenize and /detokenize (vLLM's shape; llama-server offers the same pair), and
GET /tokenizer_info (vLLM's: the special tokens and the chat template), so a client can
budget its context with the model's own tokenizer and chat template, and an evaluation
harness tokenize as the server does (lm-evaluation-harness's remote tokenizer: these
three, `add_special_tokens`, and no `model` where the server holds one).

/tokenize with `messages` counts exactly what a chat completion with the same body would
prefill (template, tools, reasoning switch: the worker renders it with the same code);
with `prompt`, what a completion would. Answered by the worker's preparation thread, so a
count does not wait for a decode slot (worker/tokens.py). The bodies follow the other
parsers' rules (api/fields/params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from aiohttp import web

from protocol.messages import Generate, Task, pack_ids
from supervisor.api.chat.request import parse_chat_request
from supervisor.api.fields.params import (all_ints, invalid_type, missing, opt_bool, opt_str,
                                          parse_model, token_ids)
from supervisor.api.lifecycle import compute
from supervisor.http.errors import APIError, read_json
from supervisor.keys import CONFIG, POOL
from supervisor.workers.errors import WorkerFailed


@dataclass(frozen=True)
class TokenizeRequest:
    model: str
    generate: Generate       # the Generate to tokenize, its task set
    return_token_strs: bool


def parse_tokenize_request(body: dict, config) -> TokenizeRequest:
    """`prompt` (a text, tokenized as a completion would be; `add_special_tokens` false:
    without the tokenizer's BOS) or `messages` (and anything else a chat completion
    takes: tools, chat_template_kwargs, reasoning_effort), rendered by the chat template
    as a chat completion would be. `model` is filled in by `default_model` first."""
    return_strs = bool(opt_bool(body, "return_token_strs"))
    if body.get("messages") is not None:
        chat = parse_chat_request({k: v for k, v in body.items()
                                   if k not in ("return_token_strs", "prompt",
                                                "add_special_tokens")})
        gen = chat.to_generate(config)
        return TokenizeRequest(chat.model, _tokenize(gen), return_strs)
    model = parse_model(body)
    prompt = opt_str(body, "prompt")
    if prompt is None:
        raise missing("prompt")
    special = opt_bool(body, "add_special_tokens") is not False
    return TokenizeRequest(model, Generate(rid="", task=Task.TOKENIZE, prompt=prompt,
                                           special_tokens=special), return_strs)


def default_model(request: web.Request, body: dict) -> dict:
    """`body` with its `model`, the server's one model where it names none (vLLM's
    tokenizer endpoints take none: a vLLM server serves one model)."""
    if body.get("model") is not None:
        return body
    runners = request.app[POOL].all_runners()
    if len(runners) != 1:
        raise missing("model")
    return {**body, "model": runners[0].id}


def _tokenize(gen: Generate) -> Generate:
    return msgspec.structs.replace(gen, task=Task.TOKENIZE)


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str
    tokens: tuple[int, ...]

    def to_generate(self) -> Generate:
        return Generate(rid="", task=Task.DETOKENIZE, prompt_ids=pack_ids(self.tokens))


def parse_detokenize_request(body: dict) -> DetokenizeRequest:
    model = parse_model(body)
    tokens = body.get("tokens")
    if tokens is None:
        raise missing("tokens")
    if not isinstance(tokens, list) or not all_ints(tokens):
        raise invalid_type("tokens", "an array of integers", tokens)
    return DetokenizeRequest(model, token_ids(tokens, "tokens"))


async def tokenize(request: web.Request) -> web.Response:
    body = default_model(request, await read_json(request))
    parsed = parse_tokenize_request(body, request.app[CONFIG])
    done = await compute(request, parsed.model, parsed.generate)
    ids = done.result.id_list()
    body = {"count": len(ids), "max_model_len": _context(request, done.model), "tokens": ids}
    if parsed.return_token_strs:
        body["token_strs"] = [p.decode("utf-8", "replace") for p in done.result.pieces]
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    parsed = parse_detokenize_request(default_model(request, await read_json(request)))
    done = await compute(request, parsed.model, parsed.to_generate())
    return web.json_response({"prompt": done.result.text})


async def tokenizer_info(request: web.Request) -> web.Response:
    """The model's tokenizer as its worker described it when it became ready (loaded
    first if it is not resident), with its context length."""
    model = parse_model(default_model(request, dict(request.query)))
    runner = await request.app[POOL].get(model)
    if not runner.tokenizer:
        await runner.wait_loaded(request.app[CONFIG].queue_timeout)
    if not runner.tokenizer:
        if runner.ready_at is not None:  # ready, and no tokenizer: a speech model
            raise APIError.bad_request(f"Model `{runner.id}` has no tokenizer.", "model",
                                       "invalid_value")
        raise WorkerFailed(f"Model `{runner.id}` is not ready"
                           + (f": {runner.last_error}" if runner.last_error else "."))
    return web.json_response({**runner.tokenizer, "model": runner.id,
                              "model_max_length": runner.context_length})


def _context(request: web.Request, model: str) -> int | None:
    runner = request.app[POOL].find(model)
    return runner.context_length if runner is not None else None


def setup(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
