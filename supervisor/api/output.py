"""A generation's output as the worker streams it, independent of any API's JSON shape.

`Part.of(batch)` folds a batch of Deltas (what one SSE write sends) into one Part:
answer text, reasoning text, complete tool calls (protocol.ToolCall), the call the output
ran out of tokens inside (`cut_call`: the Responses and Messages APIs show it) and per-token
logprobs (TokenLogprob). `Output` adds Parts up for a whole (non-streamed) response.
Chat completions and the Responses API render these their own way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import ToolCall, unpack_ids


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list                  # the token's UTF-8 bytes as ints (OpenAI's `bytes`)
    top: list                    # [(token, logprob, bytes)] best first


def _token_text(raw: bytes) -> str:
    # A token may hold part of a UTF-8 character: its text then has U+FFFD, and
    # `bytes` keeps the truth (as OpenAI does).
    return raw.decode("utf-8", errors="replace")


def token_logprobs(delta) -> list[TokenLogprob]:
    """The per-token logprobs of one Delta (empty unless the request asked for them)."""
    return [TokenLogprob(_token_text(tok), lp, list(tok),
                         [(_token_text(b), alt, list(b)) for b, alt in top])
            for tok, lp, top in delta.logprob_rows()]


@dataclass
class Part:
    """What a batch of Deltas adds to the answer."""
    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)   # [ToolCall]
    logprobs: list = field(default_factory=list)     # [TokenLogprob]
    tokens: int = 0
    cut_call: ToolCall | None = None

    @classmethod
    def of(cls, batch, want_logprobs: bool = False) -> "Part":
        part = cls()
        texts, reasoning = [], []
        for d in batch:
            texts.append(d.text)
            if d.reasoning:
                reasoning.append(d.reasoning)
            for item in d.tool_calls:
                part.tool_calls.append(ToolCall.from_wire(item))
            if d.cut is not None:
                part.cut_call = ToolCall.from_wire(d.cut)
            if want_logprobs and d.logprobs:
                part.logprobs.extend(token_logprobs(d))
            part.tokens += d.n_tokens
        part.text = "".join(texts)
        part.reasoning = "".join(reasoning)
        return part

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls or self.logprobs
                    or self.cut_call)


@dataclass
class Output:
    """A whole response's output, Part by Part."""
    text: list = field(default_factory=list)
    reasoning: list = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cut_call: ToolCall | None = None

    def add(self, part: Part) -> None:
        self.text.append(part.text)
        if part.reasoning:
            self.reasoning.append(part.reasoning)
        self.tool_calls.extend(part.tool_calls)
        self.logprobs.extend(part.logprobs)
        if part.cut_call is not None:
            self.cut_call = part.cut_call

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) or None


__all__ = ["TokenLogprob", "token_logprobs", "Part", "Output", "unpack_ids"]
