"""The Messages API's objects: the message, its content blocks, stop reasons and usage.

Usage counts as Anthropic counts it: `input_tokens` are the prompt tokens not read from
the cache, `cache_read_input_tokens` those the prefix cache supplied (so their sum is the
prompt, what count_tokens returns), `cache_creation_input_tokens` is 0: the prefix cache
stores every prompt as a side effect, at no extra cost and with no write to report.

Thinking blocks carry a `signature`, as Anthropic's do: an HMAC of the thinking text under
a key made when the server starts. Clients send signed thinking back in later turns;
mlxd does not check it (the text goes back into the template either way, and a local
model has nothing to protect by refusing edited reasoning), so the signature only keeps
clients that require the field working.

A tool call the output ran out of tokens inside (`max_tokens`) is kept as Anthropic keeps
it: the last block, a `tool_use` with the input written so far, and `stop_reason`
`max_tokens` (clients answer every tool_use or retry with more tokens; dropping it hid
that the model was calling a tool). Streamed, its input arrives as the partial JSON the
model wrote; whole, it is that text read as Anthropic's SDK reads a stream's partial input
(jiter's partial mode: a value cut off inside is left out).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import uuid

import msgspec

from protocol import FinishReason, jsontext

_SIGNING_KEY = secrets.token_bytes(32)


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def signature(thinking: str) -> str:
    digest = hmac.new(_SIGNING_KEY, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def stop_reason(done, window: int | None = None) -> str:
    """A finished generation's (`Done`) stop reason. `window`: the model's context length.
    A length stop is `max_tokens` unless the prompt and the answer filled the window:
    `max_tokens` is a ceiling here (request.py), so an answer the window cut short says
    so, as Anthropic's does (`model_context_window_exceeded`): a client then compacts its
    context rather than ask for more tokens that cannot fit."""
    if done.finish_reason == FinishReason.LENGTH:
        if window and done.prompt_tokens + done.completion_tokens >= window:
            return "model_context_window_exceeded"
        return "max_tokens"
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use"
    return "stop_sequence" if done.stop_sequence else "end_turn"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": max(0, prompt_tokens - cached_tokens),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens,
            "output_tokens": output_tokens}


def tool_input(arguments: str) -> dict:
    """A call's arguments (JSON text from the worker's tool parser) as the object
    Anthropic's `input` is."""
    value = _object(arguments)
    return {} if value is None else value


def tool_input_json(arguments: str) -> str:
    """A call's arguments as `input_json_delta` text: the worker's text as it came (the
    model's own JSON), "{}" where it is not a strict JSON object."""
    return "{}" if _object(arguments) is None else arguments


def _object(arguments: str) -> dict | None:
    """Strict: NaN, Infinity or a number beyond a double would be written back as
    `Infinity`, which no strict JSON parser takes (protocol/jsontext.py)."""
    try:
        value = jsontext.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def tool_use_block(call, cut: bool = False) -> dict:
    """A call's block; `cut`: the call the output ran out of tokens inside."""
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": cut_input(call.arguments) if cut else tool_input(call.arguments)}


def named(cut, only: str):
    """The cut call with a name, its own or `only` (the one tool it could be: tools.py
    only_tool), else None: a block without a name is no tool_use."""
    if cut is None or not (cut.name or only):
        return None
    return cut if cut.name else msgspec.structs.replace(cut, name=only)


def cut_input(arguments: str) -> dict:
    """A cut call's partial JSON as the object its complete part makes (the module's doc)."""
    from jiter import from_json  # (only a cut call needs it)

    try:
        value = from_json(arguments.encode("utf-8"), partial_mode=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content(reasoning: str | None, text: str, calls, cut=None) -> list[dict]:
    """A whole answer's blocks: thinking, then text, then tool uses, as models write them;
    `cut`, the call the output ran out of tokens inside (named: `Output.cut_call`), last."""
    blocks = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning,
                       "signature": signature(reasoning)})
    if text:
        blocks.append({"type": "text", "text": text})
    blocks.extend(tool_use_block(c) for c in calls)
    if cut is not None:
        blocks.append(tool_use_block(cut, cut=True))
    return blocks


def message(id: str, model: str, blocks: list[dict], stop: str | None,
            stop_sequence: str | None, usage: dict) -> dict:
    return {"id": id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": usage}
