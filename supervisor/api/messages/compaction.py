"""Anthropic's compaction request: `compaction: {"type": "summarize", "instructions"?}` on
POST /v1/messages (the `compact-2026-09-04` beta; the anthropic SDK's tool runner sends it
for `compact_before_next_turn()`).

The conversation in `messages` is summarised and the response is that summary alone: one
`compaction` block, `stop_reason` "compaction", nothing sampled after it. Later requests
send the block first in `messages` in place of what it summarised (request.py reads it as
a user message holding the summary), and the turn goes on from there. The summary is
written as the Responses API's compaction writes it (api/responses/summary.py): the model
reads the conversation as a transcript, and the user's first and latest requests and the
files it names head the summary; `instructions` replace the server's own request for it.
Like Anthropic's, a compaction cannot be combined with `context_management`. The block
is signed as thinking blocks are (shapes.signature) and its signature is not checked.
"""

from __future__ import annotations

from typing import Optional

from aiohttp import web

from supervisor.api.fields.params import invalid_type, invalid_value, missing
from supervisor.api.messages import shapes
from supervisor.api.messages.request import MessagesRequest
from supervisor.api.messages.stream import event
from supervisor.api.responses.request import ResponsesRequest
from supervisor.api.responses.summary import summarise
from supervisor.http import sse
from supervisor.keys import POOL


def parse(body: dict) -> Optional[str]:
    """The compaction a request asks for: its instructions ("" for the server's), or None
    for a request that is not one."""
    value = body.get("compaction")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("compaction", "an object", value)
    kind = value.get("type")
    if kind is None:
        raise missing("compaction.type")
    if kind != "summarize":
        raise invalid_value("compaction.type", f"{kind!r}. Expected 'summarize'.")
    instructions = value.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_type("compaction.instructions", "a string", instructions)
    if body.get("context_management") is not None:
        raise invalid_value("compaction", "a compaction request cannot carry "
                            "`context_management`: send one or the other.")
    return instructions or ""


def items_of(messages: tuple) -> list[dict]:
    """Chat-form messages as the Responses items the summary reads (api/responses/
    summary.py: messages, calls and their outputs)."""
    items = []
    for m in messages:
        role, content = m["role"], m.get("content")
        text = content if isinstance(content, str) else "".join(
            p.get("text", "") for p in content or [] if isinstance(p, dict))
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": m.get("tool_call_id", ""),
                          "output": text})
            continue
        if text:
            kind = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "role": role,
                          "content": [{"type": kind, "text": text}]})
        for call in m.get("tool_calls") or []:
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
    return items


async def respond(request: web.Request, parsed: MessagesRequest, instructions: str,
                  msg_id: str, headers: dict, turn) -> web.StreamResponse:
    """The compaction's message (or its stream), its summary held by the thread if any."""
    runner = await request.app[POOL].get(parsed.model)
    summary, done = await summarise(request, runner,
                                    ResponsesRequest(model=parsed.model, input_items=[]),
                                    items_of(parsed.messages), instructions)
    block = {"type": "compaction", "content": summary, "signature": shapes.signature(summary)}
    usage = shapes.usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)
    turn.record(msg_id, [block])
    if not parsed.stream:
        return web.json_response(shapes.message(msg_id, runner.id, [block], "compaction", None,
                                                usage), headers=headers)
    resp = await sse.open_stream(request, headers=headers)
    start = shapes.message(msg_id, runner.id, [], None, None, usage)
    for name, data in (
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {**block, "content": None}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                "type": "compaction_delta", "content": summary}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "usage": usage, "delta": {
                "stop_reason": "compaction", "stop_sequence": None}}),
            ("message_stop", {"type": "message_stop"})):
        await resp.write(event(name, data))
    await resp.write_eof()
    return resp
