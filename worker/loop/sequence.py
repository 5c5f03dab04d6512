"""A request as the scheduler (worker/loop/scheduler.py) tracks it, from its Generate to
its Done: where it is (preparing, waiting, in the batch), what it has streamed, and what
its steps produced that has not gone out yet (steps faster than the stream interval
share one Delta)."""

from __future__ import annotations

import time

from protocol.messages import Generate, pack_floats, pack_ids


class Sequence:
    __slots__ = ("gen", "rid", "prep", "dropped", "uid", "prompt_tokens", "completion_tokens",
                 "cached_tokens", "t0", "held_text", "held_ids", "sent_at", "held",
                 "reasoning_tokens", "started", "suspect", "stop_sequence",
                 "draft_accepted", "draft_rejected")

    def __init__(self, gen: Generate):
        self.gen = gen
        self.rid = gen.rid
        self.prep = None        # the engine's Prepared, once the preparation thread is done
        self.dropped = False    # answered while still being prepared: skip, ignore its outcome
        self.uid = None         # its id in the batch, once admitted
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied
        self.started = False    # Started was sent
        self.suspect = False    # was in a batch whose step failed: runs alone until a token
        self.t0 = time.monotonic()
        self.held_text = ""     # output of steps not sent yet (see stream_interval)
        self.held_ids = b""
        self.sent_at = 0.0      # when the last Delta left
        self.held: Held | None = None  # held reasoning, calls, logprobs (if any)
        self.reasoning_tokens = 0
        self.stop_sequence = None  # the stop string that ended it (set by the batch)
        self.draft_accepted = 0    # prediction drafts kept / rejected (set by the batch)
        self.draft_rejected = 0


class Held:
    """What steps not sent yet produced besides text and ids, for the next Delta."""
    __slots__ = ("reasoning", "tool_calls", "logprobs", "top_ids", "top_logprobs",
                 "token_bytes", "cut_call")

    def __init__(self):
        self.reasoning = ""
        self.tool_calls: list = []
        self.logprobs: list = []
        self.top_ids: list = []
        self.top_logprobs: list = []
        self.token_bytes: list = []
        self.cut_call = None

    def add(self, extra) -> None:
        self.reasoning += extra.reasoning
        for call in extra.tool_calls:
            self.tool_calls.append(call)
        if extra.cut_call is not None:
            self.cut_call = extra.cut_call
        if extra.logprob is not None:
            self.logprobs.append(extra.logprob)
            for tok, lp in extra.top:
                self.top_ids.append(tok)
                self.top_logprobs.append(lp)
            self.token_bytes.extend(extra.token_bytes)

    def fields(self) -> dict:
        return {"reasoning": self.reasoning, "tool_calls": self.tool_calls,
                "logprobs": pack_floats(self.logprobs), "top_ids": pack_ids(self.top_ids),
                "top_logprobs": pack_floats(self.top_logprobs),
                "token_bytes": self.token_bytes, "cut": self.cut_call}
