"""POST /v1/messages and POST /v1/messages/count_tokens.

A message runs the one request lifecycle (api/lifecycle.py): admission, `started` (errors
before it keep their own status, in this API's envelope), then the whole message or its
event stream. A request in a message thread (threads.py) is served as the whole
conversation it continues, and its reply is held for the next; one with `compaction` is
answered with the conversation's summary (compaction.py). count_tokens is the same
request, rendered and tokenized by the worker as generation would prefill it, without
generating (the TOKENIZE task): its count equals the `input_tokens +
cache_read_input_tokens` the same request reports. Both do the request's
`context_management` edits first (context.py) and report what they cleared.
"""

from __future__ import annotations

import time
from dataclasses import replace

from aiohttp import web

from protocol import Task
from supervisor.api.fields.tools import only_tool
from supervisor.api.lifecycle import Generation, compute, log_request, submit
from supervisor.api.messages import compaction, context, shapes
from supervisor.api.messages.errors import AnthropicEnvelope
from supervisor.api.messages.request import MessagesRequest, parse_messages_request
from supervisor.api.messages.stream import PING, BlockWriter, event
from supervisor.api.messages.threads import THREADS, Threads, Turn
from supervisor.http import sse
from supervisor.http.errors import add_envelope, get_request_id, read_json
from supervisor.keys import CONFIG

PREFIX = "/v1/messages"
# How this API's clients name the parameters the worker reports on.
PARAMS = {"max_tokens": "max_tokens", "top_k": "top_k"}


def _headers(request: web.Request, parsed: MessagesRequest, edits: context.Edits) -> dict:
    headers = {"request-id": get_request_id(request)}
    warnings = []
    if parsed.skipped_tools:
        warnings.append("skipped tools this server cannot run: "
                        + ", ".join(parsed.skipped_tools))
    if edits.skipped:
        warnings.append("skipped context_management edits this server does not do: "
                        + ", ".join(edits.skipped))
    if warnings:
        headers["X-MLXD-Warning"] = "; ".join(warnings)[:500]
    return headers


async def _parse(request: web.Request, body: dict, count_only: bool = False):
    """The request with its context edits done (context.py): (parsed, edits, the
    `context_management` a response carries or None)."""
    parsed = parse_messages_request(body, count_only=count_only)
    edits = context.parse(body.get("context_management"))
    if not edits.edits:
        return parsed, edits, {"applied_edits": []} if edits.given else None

    async def count(messages: tuple) -> int:
        message = replace(parsed, messages=messages).to_generate(request.app[CONFIG],
                                                                 Task.TOKENIZE)
        return len((await compute(request, parsed.model, message, PARAMS)).result.id_list())

    parsed, applied = await context.apply(parsed, edits, count)
    return parsed, edits, {"applied_edits": applied}


async def create_message(request: web.Request) -> web.StreamResponse:
    turn = request.app[THREADS].turn(await read_json(request), request.content_length or 0)
    try:
        return await _create(request, turn)
    finally:
        turn.close()


async def _create(request: web.Request, turn: Turn) -> web.StreamResponse:
    summarize = compaction.parse(turn.body)
    parsed, edits, managed = await _parse(request, turn.body)
    if summarize is not None:
        return await compaction.respond(request, parsed, summarize, shapes.new_message_id(),
                                        _headers(request, parsed, edits), turn)
    runner, gen = await submit(request, parsed.model,
                               parsed.to_generate(request.app[CONFIG]), PARAMS)
    t0 = time.monotonic()
    try:
        started = await gen.started()
        msg_id, headers = shapes.new_message_id(), _headers(request, parsed, edits)
        extra = {"context_management": managed} if managed is not None else {}
        if parsed.stream:
            return await _stream(request, gen, started, msg_id, runner, headers, extra,
                                 turn, only_tool(parsed.tools, parsed.tool_choice))
        output = await gen.collect()
        done = gen.done
        blocks = shapes.content(output.reasoning_text, output.content, output.tool_calls,
                                shapes.named(output.cut_call, only_tool(parsed.tools,
                                                                        parsed.tool_choice)))
        turn.record(msg_id, blocks)
        body = shapes.message(
            msg_id, runner.id, blocks, shapes.stop_reason(done, runner.context_length),
            _stop_sequence(done), shapes.usage(done.prompt_tokens, done.cached_tokens,
                                               done.completion_tokens))
        return web.json_response({**body, **extra}, headers=headers)
    finally:
        gen.close()
        log_request(request, gen, runner.id, parsed.stream, t0)


def _stop_sequence(done) -> str | None:
    return done.stop_sequence if shapes.stop_reason(done) == "stop_sequence" else None


async def _stream(request, gen: Generation, started, msg_id: str, runner, headers: dict,
                  extra: dict, turn: Turn, cut_name: str) -> web.StreamResponse:
    resp = await sse.open_stream(request, headers=headers)
    start = shapes.message(msg_id, runner.id, [], None, None,
                           shapes.usage(started.prompt_tokens, started.cached_tokens, 0))
    await resp.write(event("message_start", {"type": "message_start", "message": start}))
    blocks = BlockWriter(cut_name)
    # A failure from here on raises through: the error middleware ends the stream with
    # an `error` event in this API's shape.
    async for part in gen.parts(idle=sse.PING_INTERVAL_S):
        if part is None:
            await resp.write(PING)
            continue
        for chunk in blocks.part(part):
            await resp.write(chunk)
    for chunk in blocks.finish():
        await resp.write(chunk)
    # Held before the last events: the client's next turn may come as soon as it reads them.
    turn.record(msg_id, blocks.blocks)
    done = gen.done
    await resp.write(event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": shapes.stop_reason(done, runner.context_length),
                  "stop_sequence": _stop_sequence(done)},
        "usage": shapes.usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens),
        **extra}))
    await resp.write(event("message_stop", {"type": "message_stop"}))
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    body = request.app[THREADS].turn(await read_json(request), reserve=False).body
    parsed, edits, managed = await _parse(request, body, count_only=True)
    counted = await compute(request, parsed.model,
                            parsed.to_generate(request.app[CONFIG], Task.TOKENIZE), PARAMS)
    n = len(counted.result.id_list())
    extra = {} if managed is None else {"context_management": {"original_input_tokens": n + sum(
        e["cleared_input_tokens"] for e in managed["applied_edits"])}}
    return web.json_response({"input_tokens": n, **extra},
                             headers=_headers(request, parsed, edits))


def setup(app: web.Application) -> None:
    add_envelope(app, PREFIX, AnthropicEnvelope())
    app[THREADS] = Threads()
    app.router.add_post(PREFIX, create_message)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens)
