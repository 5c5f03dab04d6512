"""Legacy text completion bodies and stream chunks, shaped exactly as OpenAI's spec shapes
them (every required field present, as chat/shapes.py says why), and `CompletionShapes`,
the objects of one text completion that lifecycle.run renders.

Finish reasons: the text completion wire has stop|length|content_filter. It has no
"tool_calls" (it maps to "stop"); "cancelled" maps to "length", as in chat.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Optional

from supervisor.api.lifecycle import wire_finish
from supervisor.api.output import Output, Part

_TEXT_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter",
                "tool_calls": "stop", "cancelled": "length"}


def text_finish_reason(reason: str) -> str:
    """An internal (protocol) or wire finish reason → the text completion wire value."""
    return wire_finish(_TEXT_FINISH, reason)


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def text_logprobs(tokens, offset: int = 0) -> dict:
    """Legacy completions choices[].logprobs; `offset`: characters already sent. An echoed
    prompt's first token has no logprob (NaN from the worker: nothing precedes it): null,
    and null alternatives, as OpenAI's API and vLLM answer it."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        first = math.isnan(t.logprob)
        out["tokens"].append(t.token)
        out["token_logprobs"].append(None if first else t.logprob)
        out["top_logprobs"].append(None if first else {a: lp for a, lp, _ in t.top})
        out["text_offset"].append(offset)
        offset += len(t.token)
    return out


def text_completion(id: str, created: int, model: str, text: str, finish_reason: str,
                    usage: Optional[dict], *, logprobs: Optional[dict] = None,
                    system_fingerprint: Optional[str] = None, more: tuple = ()) -> dict:
    """`more`: the choices after the first (`n`, a batch of prompts), from text_choice()."""
    # The whole response is the same object as its stream's last chunk, plus usage.
    body = completion_chunk(id, created, model, text, finish_reason, logprobs=logprobs,
                            system_fingerprint=system_fingerprint)
    body["choices"].extend(more)
    if usage is not None:
        body["usage"] = usage
    return body


def text_choice(index: int, text: str, finish_reason: Optional[str] = None,
                logprobs: Optional[dict] = None) -> dict:
    """One choice of a text completion or of one of its chunks."""
    return {"text": text, "index": index, "logprobs": logprobs,
            "finish_reason": None if finish_reason is None
            else text_finish_reason(finish_reason)}


def completion_chunk(id: str, created: int, model: str, text: str,
                     finish_reason: Optional[str] = None, *, logprobs: Optional[dict] = None,
                     system_fingerprint: Optional[str] = None, index: int = 0) -> dict:
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
        "choices": [text_choice(index, text, finish_reason, logprobs)],
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


@dataclass
class CompletionShapes:
    """The objects of one text completion, streamed or whole, its choices by `index`."""
    id: str
    created: int
    model: str
    logprobs: bool = False
    sent: dict = field(default_factory=dict)  # characters streamed per choice (text_offset)

    def first_chunk(self, index: int = 0):
        return None  # legacy completions have no role chunk

    def chunks(self, part: Part, index: int = 0) -> list[dict]:
        if not (part.text or part.logprobs):
            return []
        sent = self.sent.get(index, 0)
        logprobs = text_logprobs(part.logprobs, sent) if self.logprobs else None
        self.sent[index] = sent + len(part.text)
        return [completion_chunk(self.id, self.created, self.model, part.text,
                                 logprobs=logprobs, index=index)]

    def final_chunk(self, finish_reason, index: int = 0):
        return completion_chunk(self.id, self.created, self.model, "", finish_reason,
                                index=index)

    def usage_chunk(self, usage):
        return completion_usage_chunk(self.id, self.created, self.model, usage)

    def body(self, choices: list, usage):
        """`choices`: (Output, finish reason) of each choice, by index."""
        def logprobs(output):
            return text_logprobs(output.logprobs) if self.logprobs else None

        (first, reason), rest = choices[0], choices[1:]
        return text_completion(
            self.id, self.created, self.model, first.content, reason, usage,
            logprobs=logprobs(first),
            more=tuple(text_choice(i, output.content, why, logprobs(output))
                       for i, (output, why) in enumerate(rest, 1)))
