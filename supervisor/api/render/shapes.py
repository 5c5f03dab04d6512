"""Response bodies and stream chunks, shaped exactly as OpenAI's spec shapes them.

Every field the spec marks required is present — also the required-but-nullable ones
(`message.refusal`, `choices[].logprobs`, a chunk's `finish_reason`) — because typed
clients (the official SDKs, and generated clients in other languages) fail or lose data on
a missing key. Tests validate each builder against the vendored spec and the `openai` SDK.

Finish reasons: the worker reports stop|length|tool_calls|cancelled|error (protocol); the
wire has stop|length|tool_calls|content_filter|function_call (chat) and
stop|length|content_filter (text completions). A "cancelled" request that still gets an
answer was cut off by the server (request timeout, `mlxctl kill`, shutdown): that is a
truncated output, which clients already know as "length" — "stop" would claim a natural
end. ("cancelled" by a client disconnect is never seen by anyone.) "error" is not a finish
reason on the wire: the handler answers with an error envelope or a final SSE error event
instead, so mapping it raises. Text completions have no "tool_calls": it maps to "stop".
"""

from __future__ import annotations

import uuid
from typing import Iterable, Optional

_CHAT_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                "content_filter": "content_filter", "function_call": "function_call",
                "cancelled": "length"}
_TEXT_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter",
                "tool_calls": "stop", "cancelled": "length"}


def _wire_finish(table: dict, reason: str) -> str:
    try:
        return table[reason]
    except KeyError:
        raise ValueError(f"finish_reason {reason!r} has no wire value; an 'error' finish "
                         "must be answered with an APIError / SSE error event") from None


def chat_finish_reason(reason: str) -> str:
    """An internal (protocol) or wire finish reason → the chat wire value."""
    return _wire_finish(_CHAT_FINISH, reason)


def text_finish_reason(reason: str) -> str:
    """An internal (protocol) or wire finish reason → the text completion wire value."""
    return _wire_finish(_TEXT_FINISH, reason)


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


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


def text_logprobs(tokens, offset: int = 0) -> dict:
    """Legacy completions choices[].logprobs; `offset`: characters already sent."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(t.token)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({a: lp for a, lp, _ in t.top})
        out["text_offset"].append(offset)
        offset += len(t.token)
    return out


# ---- chat completions ----------------------------------------------------------------

def chat_completion(id: str, created: int, model: str, content: Optional[str],
                    finish_reason: str, usage: Optional[dict], *,
                    tool_calls: Optional[list] = None,
                    reasoning: Optional[str] = None,
                    logprobs: Optional[dict] = None,
                    system_fingerprint: Optional[str] = None) -> dict:
    """A whole (non-streamed) chat completion. `usage` from usage(); `tool_calls` from
    tool_call(); `logprobs` from chat_logprobs(). Reasoning goes in
    `message.reasoning_content` (not OpenAI's; what vLLM, DeepSeek and most local
    servers send, so clients that show thinking find it)."""
    if tool_calls and not content:
        content = None  # OpenAI: a turn that only calls tools has null content
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": chat_finish_reason(finish_reason),
        }],
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
               system_fingerprint: Optional[str] = None) -> dict:
    """One streamed chat chunk. `delta` is e.g. {"content": "text"}; the last chunk has
    delta {} and a finish_reason. With include_usage every chunk but the usage chunk
    carries `"usage": null`, as OpenAI's do."""
    chunk = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
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
                     system_fingerprint: Optional[str] = None) -> dict:
    """The opening chunk: role "assistant" and empty content, as OpenAI sends it."""
    return chat_chunk(id, created, model, {"role": "assistant", "content": ""},
                      include_usage=include_usage, system_fingerprint=system_fingerprint)


def chat_usage_chunk(id: str, created: int, model: str, usage: dict, *,
                     system_fingerprint: Optional[str] = None) -> dict:
    """The extra last chunk of stream_options.include_usage: no choices, the usage."""
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [], "usage": usage}
    if system_fingerprint is not None:
        chunk["system_fingerprint"] = system_fingerprint
    return chunk


# ---- text completions ----------------------------------------------------------------

def text_completion(id: str, created: int, model: str, text: str, finish_reason: str,
                    usage: Optional[dict], *, logprobs: Optional[dict] = None,
                    system_fingerprint: Optional[str] = None) -> dict:
    # The whole response is the same object as its stream's last chunk, plus usage.
    body = completion_chunk(id, created, model, text, finish_reason, logprobs=logprobs,
                            system_fingerprint=system_fingerprint)
    if usage is not None:
        body["usage"] = usage
    return body


def completion_chunk(id: str, created: int, model: str, text: str,
                     finish_reason: Optional[str] = None, *, logprobs: Optional[dict] = None,
                     system_fingerprint: Optional[str] = None) -> dict:
    """One streamed text completion chunk; OpenAI streams these with the same object as
    the whole response ("text_completion") and finish_reason null until the last one.
    (The spec has no separate chunk schema, and its finish_reason is not nullable there:
    the null is what the real API and the SDK's stream parser use.) No `"usage": null`
    on these chunks: CreateCompletionResponse.usage is not nullable."""
    chunk = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                     "finish_reason": None if finish_reason is None
                     else text_finish_reason(finish_reason)}],
    }
    if system_fingerprint is not None:
        chunk["system_fingerprint"] = system_fingerprint
    return chunk


def completion_usage_chunk(id: str, created: int, model: str, usage: dict, *,
                           system_fingerprint: Optional[str] = None) -> dict:
    """Last chunk of a text completion stream with stream_options.include_usage."""
    chunk = {"id": id, "object": "text_completion", "created": created, "model": model,
             "choices": [], "usage": usage}
    if system_fingerprint is not None:
        chunk["system_fingerprint"] = system_fingerprint
    return chunk


# ---- models --------------------------------------------------------------------------

def model_object(id: str, created: int, owned_by: str = "mlxd", **extra) -> dict:
    """An entry of /v1/models. Extra keys (e.g. context_length, state) ride along; clients
    ignore what they do not know."""
    return {"id": id, "object": "model", "created": created, "owned_by": owned_by, **extra}


def model_list(models: Iterable[dict]) -> dict:
    return {"object": "list", "data": list(models)}
