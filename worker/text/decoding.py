"""One sequence's side of a batched decode: what its sampled tokens become.

The batch (worker/loop/batch.py, on mlx-lm's BatchGenerator) runs the model for every sequence
at once and hands back, per step and per sequence, the sampled token and the
log-probability row it was sampled from. Everything after that is per sequence and lives
here, in `Decoding`: detokenizing, stop strings, the reasoning / tool-call splitter, the
logprobs a request asked for, and the grammar.

The grammar is the one part that must act INSIDE the batch step: the next token's mask
depends on this token. mlx-lm's batch calls each sequence's logits processors with the
token it is about to feed the model (the token sampled one step earlier), before
sampling the next one; `GrammarMask` is such a processor: it advances the grammar by that
token and masks the logits. So by the time a token reaches `feed`, the grammar has
already consumed it. The first call of a sequence carries the last PROMPT token, which the
grammar must not see. A processor must never raise inside the batch (that would fail
every sequence in it): a grammar failure is kept, and `feed` raises it as this request's
error (GrammarError is a RequestError: a 400-class answer, the worker keeps serving).

`feed` returns `(token, text, finish, extra)` per step, as the single-sequence generator
did: token is -1 on an EOS step (nothing to report but held-back text); finish is None
until the last step, then a FinishReason; `extra` (a StepExtra, or None for plain
requests) carries reasoning, tool calls and logprobs.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from protocol.messages import FinishReason, ToolCall
from worker.text import sampling
from worker.text.constraints import GrammarError
from worker.text.stops import StopMatcher

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
_NEG_INF = None  # made on first use, on the MLX thread


class StepExtra:
    """What a decode step produced besides answer text (only for requests that need it)."""
    __slots__ = ("reasoning", "tool_calls", "in_reasoning", "logprob", "top", "token_bytes",
                 "cut_call")

    def __init__(self, reasoning: str = "", tool_calls: tuple = (), in_reasoning: bool = False):
        self.reasoning = reasoning
        self.tool_calls: tuple[ToolCall, ...] = tool_calls
        self.in_reasoning = in_reasoning      # the token was spent reasoning
        self.logprob: Optional[float] = None  # None: logprobs were not asked for
        self.top: list = []                   # [(id, logprob)] best first
        self.token_bytes: list = []           # the token's bytes, then each top entry's
        self.cut_call: Optional[ToolCall] = None  # the call the output ran out inside


class GrammarMask:
    """The grammar as a logits processor of mlx-lm's batch (see the module docstring)."""
    __slots__ = ("constraint", "eos", "primed", "failure")

    def __init__(self, constraint, eos: frozenset):
        self.constraint = constraint
        self.eos = eos
        self.primed = False                        # the prompt's last token went by
        self.failure: Optional[Exception] = None   # raised by `feed`, not here

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        global _NEG_INF
        if self.failure is not None:
            return logits
        try:
            if self.primed:
                tok = context[-1].item()
                if tok in self.eos:
                    return logits  # the sequence ends on it: nothing more to mask
                self.constraint.consume(tok)
            self.primed = True
            if self.constraint.done:
                return logits  # complete: `feed` ends the sequence on this token
            if _NEG_INF is None:
                _NEG_INF = mx.array(-mx.inf)
            return mx.where(self.constraint.mask(), logits, _NEG_INF)
        except Exception as e:  # never into the batch step: see the module docstring
            self.failure = e
            return logits


def keep_first_space(detok) -> None:
    """mlx-lm's BPE and SPM streaming detokenizers drop the first output token's leading
    space, as a chat reply starts without one; a raw prompt's output continues the
    prompt, and there the space is the text's own ("The capital of France is" + " Paris",
    and a code completion's indentation). Other detokenizers keep it already."""
    if isinstance(detok, SPMStreamingDetokenizer):
        detok.trim_space = False
    elif isinstance(detok, BPEStreamingDetokenizer):
        detok._maybe_trim_space = lambda text: text  # (its only trim; an instance's copy)


class Decoding:
    """One sequence's detokenizer, stops, splitter, grammar and logprobs."""

    def __init__(self, engine, prep, budget: int):
        out = prep.gen.output
        self.engine = engine
        self.budget = budget                  # completion tokens at most
        self.detok = engine.tokenizer.detokenizer
        self.continues = prep.gen.messages is None  # a raw prompt: the output continues it
        if self.continues:
            keep_first_space(self.detok)
        self.stops = StopMatcher(out.stop) if out.stop else None
        self.splitter = prep.splitter
        self.constraint = prep.constraint
        self.k = out.top_logprobs if out.logprobs else -1
        self.eos = engine.eos
        self.grammar = GrammarMask(prep.constraint, self.eos) if prep.constraint else None
        # Plain requests take the short path: no extras, no per-step objects.
        self.full = self.constraint is not None or self.splitter is not None or self.k >= 0
        self.produced = 0

    def feed(self, tok: int, row: Optional[mx.array]):
        """One sampled token (and the log-probability row it came from)."""
        if self.grammar is not None and self.grammar.failure is not None:
            e = self.grammar.failure
            if isinstance(e, GrammarError):
                raise e
            raise RuntimeError("the grammar failed") from e
        self.produced += 1
        if tok in self.eos:
            return (-1, *self._finish(tok, row))
        extra = None
        if self.full:
            extra = StepExtra(in_reasoning=self.splitter is not None and self.splitter.reasoning)
            if self.k >= 0:
                self._read_logprobs(extra, tok, row)
        detok = self.detok
        detok.add_token(tok)
        text = detok.last_segment
        if self.stops is not None:
            text, hit = self.stops.feed(text)
            if hit:
                return (tok, *self._split(text, extra, STOP, final=True))
        done = self.constraint is not None and self.constraint.done
        if done or self.produced >= self.budget:
            # done: the grammar is complete, only EOS could follow, so end here.
            detok.finalize()
            tail, hit = self._tail(detok.last_segment)
            finish = STOP if done or hit else LENGTH
            return (tok, *self._split(text + tail, extra, finish, final=True))
        return (tok, *self._split(text, extra, None))

    @property
    def stop_sequence(self) -> Optional[str]:
        """The stop string that ended the output (None: none did)."""
        return self.stops.matched if self.stops is not None else None

    def _split(self, text, extra, finish, final=False):
        """(answer text, finish, extra) of a step: reasoning and calls split off."""
        splitter = self.splitter
        if splitter is None:
            return text, finish, extra
        content, reasoning, calls = splitter.feed(text)
        if final:
            c2, r2, k2 = splitter.finish(cut=finish == LENGTH)
            content, reasoning, calls = content + c2, reasoning + r2, calls + k2
            extra.cut_call = splitter.cut_call
        extra.reasoning, extra.tool_calls = reasoning, calls
        if finish == STOP and splitter.made_calls:
            finish = FinishReason.TOOL_CALLS
        return content, finish, extra

    def _finish(self, tok: int, row: Optional[mx.array]):
        """The EOS step: flush the detokenizer, the stop matcher and the splitter. A raw
        prompt's logprobs end with the EOS token's own row (its text never in the output),
        as OpenAI's legacy completions and vLLM report the token that stopped them: an
        evaluation harness scoring a continuation with `echo` and `max_tokens: 1` drops the
        last row as the generated token's, and one more missing cost it the
        continuation's last token wherever the model would end there."""
        self.detok.finalize()
        text = self._tail(self.detok.last_segment)[0]
        extra = StepExtra() if self.full else None
        if extra is not None and self.k >= 0 and self.continues:
            self._read_logprobs(extra, tok, row)
        return self._split(text, extra, STOP, final=True)

    def _read_logprobs(self, extra, tok: int, row: mx.array) -> None:
        extra.logprob, extra.top = sampling.read_logprobs(row, tok, self.k)
        extra.token_bytes = [self.engine.token_bytes(tok)] + [
            self.engine.token_bytes(t) for t, _ in extra.top]

    def _tail(self, text: str) -> tuple[str, bool]:
        """The last text of a finished sequence: what the detokenizer flushed, through
        the stop matcher, plus whatever the matcher still held back."""
        stops = self.stops
        if stops is None:
            return text, False
        text, hit = stops.feed(text)
        return (text, True) if hit else (text + stops.flush(), False)
