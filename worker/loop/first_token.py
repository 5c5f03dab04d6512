"""A sequence's first token read the step it is computed, where nothing is lost by it.

mlx-lm keeps one step in flight: the step that ends a prompt only launches the first
token's computation, and the next step launches the second token's before it reads the
first. When the batch decodes nothing else, nothing is gained by that wait: the first
token is read at once, one step (one forward pass launched, on a GPU several ms of the
CPU's time) sooner. mlx-lm still reports that token at the next step; the batch skips
that report (worker/loop/batch.py `Member.first_read`). With other sequences decoding,
reading now would stall their step in flight: they keep mlx-lm's order. So does a
grammar: it consumes each token inside the next step (worker/text/decoding.py), before
the batch's `Decoding.feed` sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx


@dataclass
class FirstToken:
    """A token read as soon as it was computed, shaped as mlx-lm's responses are."""
    uid: int
    token: int
    logprobs: Any
    finish_reason: Optional[str] = None
    prompt_cache: Any = None
    all_tokens: Any = None


def read_first(gen, members: dict, joined: list[int]) -> list[FirstToken]:
    """The first tokens of `joined` (the sequences whose prompts `gen`, mlx-lm's
    BatchGenerator, ended this step), read now when they are all its generation batch
    holds and none has a grammar; [] otherwise. Marks each member `first_read`."""
    gb = getattr(gen, "_generation_batch", None)
    if not joined or gb is None or sorted(getattr(gb, "uids", ())) != sorted(joined):
        return []
    if any(members[u].decoding.grammar is not None for u in joined if u in members):
        return []
    tokens, logprobs = getattr(gb, "_next_tokens", None), getattr(gb, "_next_logprobs", None)
    if tokens is None or logprobs is None or len(logprobs) != len(gb.uids):
        return []
    mx.eval(tokens, logprobs)
    out = []
    for uid, tok, lp in zip(gb.uids, tokens.tolist(), logprobs):
        m = members.get(uid)
        if m is not None:
            m.first_read = True
            out.append(FirstToken(uid, tok, lp))
    return out
