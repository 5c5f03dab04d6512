"""Chat completion bodies and stream chunks, shaped exactly as OpenAI's spec shapes them,
and `ChatShapes`, the objects of one chat completion that lifecycle.run renders.

Every field the spec marks required is present — also the required-but-nullable ones
(`message.refusal`, `choices[].logprobs`, a chunk's `finish_reason`) — because typed
clients (the official SDKs, and generated clients in other languages) fail or lose data on
a missing key. Tests validate each builder against the vendored spec and the `openai` SDK.

Finish reasons: the worker reports stop|length|tool_calls|cancelled|error (protocol); the
chat wire has stop|length|tool_calls|content_filter|function_call. A "cancelled" request
that still gets an answer was cut off by the server (request timeout, `mlxctl kill`,
shutdown): that is a truncated output, which clients already know as "length" — "stop"
would claim a natural end. ("cancelled" by a client disconnect is never seen by anyone.)
"error" is not a finish reason on the wire (lifecycle.wire_finish raises on it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional

from supervisor.api.lifecycle import wire_finish
from supervisor.api.output import Output, Part

_CHAT_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                "content_filter": "content_filter", "function_call": "function_call",
                "cancelled": "length"}


def chat_finish_reason(reason: str) -> str:
    """An internal (protocol) or wire finish reason → the chat wire value."""
    return wire_finish(_CHAT_FINISH, reason)


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


# ---- tool calls and logprobs (from supervisor.api.output's neutral items) -----------

def tool_call(call) -> dict:
    """A protocol.ToolCall as a chat message's tool call."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(call) -> list[dict]:
    """A complete call as the stream deltas OpenAI sends: the id and name first (with
    empty arguments), then the arguments (here in one fragment)."""
    return [
        {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}]},
        {"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]},
    ]


def chat_logprobs(tokens) -> dict:
    """ChatCompletion choices[].logprobs from TokenLogprob items."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
                         "top_logprobs": [{"token": a, "logprob": lp, "bytes": b}
                                          for a, lp, b in t.top]}
                        for t in tokens],
            "refusal": None}


# ---- chat completions ----------------------------------------------------------------

def chat_choice(index: int, content: Optional[str], finish_reason: str, *,
                tool_calls: Optional[list] = None, reasoning: Optional[str] = None,
                logprobs: Optional[dict] = None) -> dict:
    """One choice of a whole chat completion (chat_completion says what each part is)."""
    if tool_calls and not content:
        content = None  # OpenAI: a turn that only calls tools has null content
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(finish_reason)}


def chat_completion(id: str, created: int, model: str, content: Optional[str],
                    finish_reason: str, usage: Optional[dict], *,
                    tool_calls: Optional[list] = None,
                    reasoning: Optional[str] = None,
                    logprobs: Optional[dict] = None,
                    system_fingerprint: Optional[str] = None,
                    more: tuple = ()) -> dict:
    """A whole (non-streamed) chat completion. `usage` from usage(); `tool_calls` from
    tool_call(); `logprobs` from chat_logprobs(). Reasoning goes in
    `message.reasoning_content` (not OpenAI's; what vLLM, DeepSeek and most local
    servers send, so clients that show thinking find it). `more`: the choices after the
    first (`n`), from chat_choice()."""
    body = {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [chat_choice(0, content, finish_reason, tool_calls=tool_calls,
                                reasoning=reasoning, logprobs=logprobs), *more],
        "usage": usage,
    }
    if usage is None:
        del body["usage"]  # optional, and not nullable in the spec
    if system_fingerprint is not None:
        body["system_fingerprint"] = system_fingerprint
    return body


def chat_chunk(id: str, created: int, model: str, delta: dict,
               finish_reason: Optional[str] = None, *, include_usage: bool = False,
               logprobs: Optional[dict] = None,
               system_fingerprint: Optional[str] = None, index: int = 0) -> dict:
    """One streamed chat chunk of choice `index`. `delta` is e.g. {"content": "text"}; a
    choice's last chunk has delta {} and a finish_reason. With include_usage every chunk
    but the usage chunk carries `"usage": null`, as OpenAI's do."""
    chunk = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None if finish_reason is None else chat_finish_reason(finish_reason),
        }],
    }
    if system_fingerprint is not None:
        chunk["system_fingerprint"] = system_fingerprint
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_first_chunk(id: str, created: int, model: str, *, include_usage: bool = False,
                     system_fingerprint: Optional[str] = None, index: int = 0) -> dict:
    """A choice's opening chunk: role "assistant" and empty content, as OpenAI sends it."""
    return chat_chunk(id, created, model, {"role": "assistant", "content": ""},
                      include_usage=include_usage, system_fingerprint=system_fingerprint,
                      index=index)


def chat_usage_chunk(id: str, created: int, model: str, usage: dict, *,
                     system_fingerprint: Optional[str] = None) -> dict:
    """The extra last chunk of stream_options.include_usage: no choices, the usage."""
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [], "usage": usage}
    if system_fingerprint is not None:
        chunk["system_fingerprint"] = system_fingerprint
    return chunk


@dataclass
class ChatShapes:
    """The objects of one chat completion, streamed or whole, its choices by `index`."""
    id: str
    created: int
    model: str
    include_usage: bool
    logprobs: bool = False

    def _chunk(self, index: int, delta: dict, logprobs=None) -> dict:
        return chat_chunk(self.id, self.created, self.model, delta,
                          include_usage=self.include_usage, logprobs=logprobs, index=index)

    def first_chunk(self, index: int = 0):
        return chat_first_chunk(self.id, self.created, self.model,
                                include_usage=self.include_usage, index=index)

    def chunks(self, part: Part, index: int = 0) -> list[dict]:
        """Reasoning, answer text (with the batch's logprobs) and tool calls, in the order
        the model produced them within one batch (reasoning comes before the answer)."""
        out = []
        if part.reasoning:
            out.append(self._chunk(index, {"reasoning_content": part.reasoning}))
        logprobs = chat_logprobs(part.logprobs) if part.logprobs else None
        if part.text or logprobs:
            out.append(self._chunk(index, {"content": part.text}, logprobs))
        for call in part.tool_calls:
            out.extend(self._chunk(index, d) for d in tool_call_deltas(call))
        return out

    def final_chunk(self, finish_reason, index: int = 0):
        return chat_chunk(self.id, self.created, self.model, {}, finish_reason,
                          include_usage=self.include_usage, index=index)

    def usage_chunk(self, usage):
        return chat_usage_chunk(self.id, self.created, self.model, usage)

    def _parts(self, output: Output) -> dict:
        return {"tool_calls": [tool_call(c) for c in output.tool_calls],
                "reasoning": output.reasoning_text,
                "logprobs": chat_logprobs(output.logprobs) if self.logprobs else None}

    def body(self, choices: list, usage):
        """`choices`: (Output, finish reason) of each choice, by index."""
        (first, reason), rest = choices[0], choices[1:]
        return chat_completion(
            self.id, self.created, self.model, first.content, reason, usage,
            **self._parts(first),
            more=tuple(chat_choice(i, output.content, why, **self._parts(output))
                       for i, (output, why) in enumerate(rest, 1)))
