"""The text engine: prompt preparation and one generator per request (mlx-lm models).

`prepare` turns a Generate into prompt token ids and checks it against the context
BEFORE any compute, raising RequestError with an OpenAI-style code and message; it also
builds the request's grammar (worker/constraints.py: a bad schema is a 400 here, before
any token) and its output splitter (worker/channels.py: reasoning and tool calls). It
calls no MLX, so it runs on the preparation thread (worker/preparer.py) while the MLX
thread decodes; a prompt whose byte length alone proves it cannot fit is refused before
it is tokenized (worker/token_bound.py).
`generate` is one generator in the style of mlx-lm's `generate_step`/`stream_generate`:
it yields `None` after every prefill chunk (a point where the scheduler can cancel or
look at new commands) and one `(token, text, finish, extra)` tuple per decode step.

The decode loop is the hot path. It keeps ONE step in flight (`mx.async_eval` of the next
step before `.item()` of the current one), so the Python work of a step (detokenizing,
stop strings, building the Delta) overlaps the computation of the next one. Per step it
does no logging, no extra syncs and as few allocations as it can. Plain requests take
`_decode_plain`, untouched by the features of `_decode_full` (grammar, reasoning and
tool-call splitting, logprobs).

A failed step must not outlive its request: `recover()` reseeds the random key a failed
compiled sampler leaves without a primitive (worker/sampling.py), clears MLX's buffer
cache, and proves with a one-token probe that a step still runs; if it does not, the
caller recycles the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from protocol.messages import (CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, FinishReason, Generate,
                               SamplingParams, ToolCall, unpack_ids)
from worker import prompt as chat_prompt
from worker import sampling, tool_formats
from worker.channels import REASONING, OutputSplitter
from worker.constraints import Constraint, GrammarError, Grammars
from worker.prompt import RequestError  # noqa: F401  (re-exported: callers catch it here)
from worker.stops import StopMatcher
from worker.token_bound import TokenBound

# mlx-lm clears the buffer cache every 256 tokens: often enough to bound the cache,
# rarely enough to cost nothing measurable.
_CLEAR_CACHE_EVERY = 256
# Texts shorter than this are tokenized (~0.1 s at most) rather than judged by the bound.
_BOUND_MIN_CHARS = 100_000
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


@dataclass
class Prepared:
    """A request checked and ready to generate: prompt ids and its output machinery."""
    gen: Generate
    ids: list
    constraint: Optional[Constraint] = None      # the grammar, if any
    splitter: Optional[OutputSplitter] = None    # reasoning / tool-call parsing, if any
    banned: tuple = ()                           # token ids never to sample

    def __len__(self) -> int:
        return len(self.ids)


class StepExtra:
    """What a decode step produced besides answer text (only for requests that need it)."""
    __slots__ = ("reasoning", "tool_calls", "in_reasoning", "logprob", "top", "token_bytes")

    def __init__(self, reasoning: str = "", tool_calls: tuple = (), in_reasoning: bool = False):
        self.reasoning = reasoning
        self.tool_calls: tuple[ToolCall, ...] = tool_calls
        self.in_reasoning = in_reasoning      # the token was spent reasoning
        self.logprob: Optional[float] = None  # None: logprobs were not asked for
        self.top: list = []                   # [(id, logprob)] best first
        self.token_bytes: list = []           # the token's bytes, then each top entry's


class TextEngine:
    def __init__(self, model, tokenizer, context_length: int, prefill_step: int = 512,
                 vocab_size: int | None = None):
        self.model = model
        self.tokenizer = tokenizer  # mlx-lm TokenizerWrapper
        self.context_length = context_length
        self.prefill_step = max(1, prefill_step)
        self.vocab_size = vocab_size or len(tokenizer)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self.tool_format = tool_formats.detect(tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.tool_format)
        self.bound = TokenBound(tokenizer)
        self._token_bytes: dict[int, bytes] = {}

    # ---- preparation (no MLX compute) -----------------------------------------------

    def prepare(self, gen) -> Prepared:
        """Prompt ids for `gen`, checked against the context length, and the request's
        grammar and output splitter. Raises RequestError (shown to the client)."""
        max_tokens = gen.sampling.max_tokens
        if gen.messages is not None:
            param = "messages"
            text, special = chat_prompt.chat_text(self.tokenizer, gen)
            self._check_bound(text, max_tokens, param)
            ids = list(self.tokenizer.encode(text, add_special_tokens=special))
        elif gen.prompt_ids is not None:
            param = "prompt"
            ids = unpack_ids(gen.prompt_ids)
            bad = [i for i in ids if i >= self.vocab_size]
            if bad:
                raise RequestError(INVALID_REQUEST, f"token id {bad[0]} is out of range: the "
                                   f"vocabulary has {self.vocab_size} tokens", param)
        elif gen.prompt is not None:
            param = "prompt"
            tok = self.tokenizer
            self._check_bound(gen.prompt, max_tokens, param)
            # Like stream_generate: add BOS unless the prompt already starts with it.
            special = tok.bos_token is None or not gen.prompt.startswith(tok.bos_token)
            ids = tok.encode(gen.prompt, add_special_tokens=special)
        else:
            raise RequestError(INVALID_REQUEST, "a request needs messages or a prompt", "prompt")
        if not ids:
            raise RequestError(INVALID_REQUEST, "the prompt is empty", param)
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(INVALID_REQUEST, "max_tokens must be at least 1", "max_tokens",
                               len(ids))
        self._check_context(len(ids), max_tokens, param)
        sampling.check_logit_bias(gen.sampling, self.vocab_size)
        sampling.check_sampler_values(gen.sampling)
        return self._outputs(gen, ids)

    def _outputs(self, gen, ids: list[int]) -> Prepared:
        """The grammar and the splitter a request needs (none for plain completions)."""
        prep = Prepared(gen, ids)
        out = gen.output
        chat = gen.messages is not None
        reasoning_first = chat and chat_prompt.starts_in_reasoning(self.tokenizer, ids)
        may_think = chat and not chat_prompt.thinking_closed(self.tokenizer, ids)
        try:
            prep.constraint = self.grammars.constraint(out, reasoning_first, may_think)
        except GrammarError as e:
            e.prompt_tokens = len(ids)
            raise
        fmt = self.tool_format
        calls = bool(out.tools) and out.tool_choice != "none"
        if chat and out.tools and out.tool_choice == "none" and fmt is not None and fmt.start:
            # "none" means no calls: the marker that opens one cannot be sampled.
            start = self.tokenizer.encode(fmt.start, add_special_tokens=False)
            if len(start) == 1:
                prep.banned = (start[0],)
        if chat and (self.tokenizer.has_thinking or (calls and fmt is not None)):
            prep.splitter = OutputSplitter(self.tokenizer, fmt if calls else None, out.tools,
                                           REASONING if reasoning_first else "normal")
        return prep

    def _check_bound(self, text: str, max_tokens: int | None, param: str) -> None:
        """Refuse, without tokenizing, a text whose byte length alone proves that it
        cannot fit (a lower bound on its tokens: worker/token_bound.py). Short texts are
        left to the exact count: it costs nothing and reports the real number."""
        if len(text) >= _BOUND_MIN_CHARS:
            self._check_context(self.bound.at_least(text), max_tokens, param, bound=True)

    def _check_context(self, n: int, max_tokens: int | None, param: str,
                       bound: bool = False) -> None:
        ctx = self.context_length
        where = "the messages" if param == "messages" else "the prompt"
        count = f"at least {n}" if bound else f"{n}"
        used = 0 if bound else n  # usage reports only what was really counted
        if max_tokens is None:
            if n >= ctx:
                raise RequestError(
                    CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {ctx} tokens. However, "
                    f"{where} resulted in {count} tokens, leaving no room for the "
                    f"completion. Please reduce the length of {where}.", param, used)
        elif n + max_tokens > ctx:
            raise RequestError(
                CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {ctx} tokens. However, you "
                f"requested {'at least ' if bound else ''}{n + max_tokens} tokens ({count} "
                f"in {where}, {max_tokens} in the completion). Please reduce the length of "
                f"{where} or completion.", param, used)

    # ---- generation -------------------------------------------------------------------

    def generate(self, prep: Prepared):
        """Yield None per prefill chunk, then (token, text, finish, extra) per decode step.

        token is -1 on the final step when it ends on EOS (no token to report; `text`
        may still carry text the detokenizer or the stop matcher held back). finish is
        None until the last yield, then a FinishReason (stop, length or tool_calls).
        `text` is the answer; `extra` (a StepExtra, or None for plain requests) carries
        reasoning, tool calls and logprobs.
        """
        sp, out, ids = prep.gen.sampling, prep.gen.output, prep.ids
        n = len(ids)
        budget = self.context_length - n
        if sp.max_tokens is not None:
            budget = min(budget, sp.max_tokens)
        sampler = sampling.sampler_for(sp, self.vocab_size)
        processors = sampling.processors_for(sp, prep.banned)
        if sp.seed is not None:
            # One sequence at a time: this makes it reproducible.
            mx.random.seed(sampling.seed_value(sp.seed))

        model, stream = self.model, generation_stream
        cache = make_prompt_cache(model)
        prompt = mx.array(ids, dtype=mx.uint32)
        history = None  # the tokens the logits processors see (penalties)

        def logits_of(tokens):
            """The next logits (call inside `mx.stream(generation_stream)`)."""
            nonlocal history
            logits = model(tokens[None], cache=cache)[:, -1, :]
            if processors:
                history = mx.concatenate([history, tokens])
                for p in processors:
                    logits = p(history, logits)
            return logits

        # Prefill all but the last prompt token, one chunk per yield.
        pos, chunk = 0, self.prefill_step
        while n - pos > 1:
            k = min(chunk, n - pos - 1)
            with mx.stream(stream):
                model(prompt[pos:pos + k][None], cache=cache)
                mx.eval([c.state for c in cache])
            pos += k
            mx.clear_cache()
            yield None

        if processors:
            history = prompt[:pos]  # logits_of() appends what it feeds the model
        detok = self.tokenizer.detokenizer
        stops = StopMatcher(out.stop) if out.stop else None
        if prep.constraint is None and prep.splitter is None and not out.logprobs:
            yield from self._decode_plain(prompt[pos:], logits_of, sampler, budget, detok, stops)
        else:
            yield from self._decode_full(prep, prompt[pos:], logits_of, sampler, budget,
                                         detok, stops)

    def _decode_plain(self, first, logits_of, sampler, budget, detok, stops):
        """The hot path: no grammar, no splitting, no logprobs. ONE step in flight."""
        eos = self._eos

        def step(tokens):
            with mx.stream(generation_stream):
                logits = logits_of(tokens)
                # Log-probabilities as mlx-lm samples them (top_p/min_p expect them).
                return sampler(logits - mx.logsumexp(logits, keepdims=True))

        y = step(first)
        mx.async_eval(y)
        produced = 0
        while True:
            produced += 1
            if produced < budget:
                next_y = step(y)
                mx.async_eval(next_y)
            tok = y.item()
            if tok in eos:
                detok.finalize()
                yield -1, self._tail(detok.last_segment, stops)[0], STOP, None
                return
            detok.add_token(tok)
            text = detok.last_segment
            if stops is not None:
                text, hit = stops.feed(text)
                if hit:
                    yield tok, text, STOP, None
                    return
            if produced >= budget:
                detok.finalize()
                tail, hit = self._tail(detok.last_segment, stops)
                yield tok, text + tail, STOP if hit else LENGTH, None
                return
            yield tok, text, None, None
            if produced % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
            y = next_y

    def _decode_full(self, prep, first, logits_of, sampler, budget, detok, stops):
        """Grammar, reasoning/tool-call splitting and/or logprobs.

        With a grammar the next token's mask depends on this token, so its sampling waits
        for it. The rest stays in flight: as soon as a token is known and consumed, the
        next mask is computed (llguidance, native, GIL released) while MLX runs the
        forward pass already queued on the lazily sampled token; then the next sample
        and the forward pass after it are queued, and only then does the Python work of
        this token (detokenizing, splitting, the Delta) run."""
        out, eos = prep.gen.output, self._eos
        constraint, splitter = prep.constraint, prep.splitter
        k = out.top_logprobs if out.logprobs else -1
        neg_inf = mx.array(-mx.inf)

        def sample(logits):
            mask = constraint.mask() if constraint is not None else None
            with mx.stream(generation_stream):
                if mask is not None:
                    logits = mx.where(mask, logits, neg_inf)
                logprobs = logits - mx.logsumexp(logits, keepdims=True)
                y = sampler(logprobs)
                lp = sampling.logprob_arrays(logprobs, y, k) if k >= 0 else ()
            mx.async_eval(y, *lp)
            return y, lp

        def forward(y):
            with mx.stream(generation_stream):
                logits = logits_of(y)
            mx.async_eval(logits)
            return logits

        y, lp = sample(forward(first))
        logits = forward(y) if budget > 1 else None
        produced = 0
        while True:
            produced += 1
            tok = y.item()
            if tok in eos:
                yield -1, *self._finish(detok, stops, splitter, STOP)
                return
            if constraint is not None:
                constraint.consume(tok)  # GrammarError: the request's, not the worker's
            done = constraint is not None and constraint.done
            if produced < budget and not done:
                next_y, next_lp = sample(logits)
                if produced + 1 < budget:
                    logits = forward(next_y)
            extra = StepExtra(in_reasoning=splitter is not None and splitter.reasoning)
            if k >= 0:
                extra.logprob, extra.top = sampling.read_logprobs(lp)
                extra.token_bytes = [self.token_bytes(tok)] + [self.token_bytes(t)
                                                              for t, _ in extra.top]
            detok.add_token(tok)
            text = detok.last_segment
            if stops is not None:
                text, hit = stops.feed(text)
                if hit:
                    yield tok, *self._split(text, splitter, extra, STOP, final=True)
                    return
            if done or produced >= budget:
                # done: the grammar is complete, only EOS could follow, so end here.
                detok.finalize()
                tail, hit = self._tail(detok.last_segment, stops)
                finish = STOP if done or hit else LENGTH
                yield tok, *self._split(text + tail, splitter, extra, finish, final=True)
                return
            yield tok, *self._split(text, splitter, extra, None)
            if produced % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
            y, lp = next_y, next_lp

    @staticmethod
    def _split(text, splitter, extra, finish, final=False):
        """(answer text, finish, extra) of a step: reasoning and calls split off."""
        if splitter is None:
            return text, finish, extra
        content, reasoning, calls = splitter.feed(text)
        if final:
            c2, r2, k2 = splitter.finish()
            content, reasoning, calls = content + c2, reasoning + r2, calls + k2
        extra.reasoning, extra.tool_calls = reasoning, calls
        if finish == STOP and splitter.made_calls:
            finish = FinishReason.TOOL_CALLS
        return content, finish, extra

    def _finish(self, detok, stops, splitter, finish):
        """The EOS step: flush the detokenizer, the stop matcher and the splitter."""
        detok.finalize()
        text = self._tail(detok.last_segment, stops)[0]
        return self._split(text, splitter, StepExtra(), finish, final=True)

    def token_bytes(self, tok: int) -> bytes:
        """A token's exact bytes (logprobs' `bytes`; may be part of a UTF-8 character)."""
        b = self._token_bytes.get(tok)
        if b is None:
            try:
                b = self.grammars.ll_tokenizer.decode_bytes([tok])
            except GrammarError:  # a slow tokenizer: its text is the best we have
                b = self.tokenizer.decode([tok]).encode("utf-8")
            self._token_bytes[tok] = b
        return b

    @staticmethod
    def _tail(text: str, stops: StopMatcher | None) -> tuple[str, bool]:
        """The last text of a finished sequence: what the detokenizer flushed, through
        the stop matcher, plus whatever the matcher still held back."""
        if stops is None:
            return text, False
        text, hit = stops.feed(text)
        return (text, True) if hit else (text + stops.flush(), False)

    def warmup(self) -> None:
        """One tiny forward pass and a sample, so the first request pays no setup."""
        self._tiny_run(temperature=0.0, max_tokens=2)
        mx.clear_cache()

    def recover(self) -> None:
        """After a request failed inside a step: drop what it may have left in MLX's
        global state, then prove that a step still runs. Raises if one does not (the
        worker then cannot serve, and must be replaced)."""
        sampling.reseed()  # a failed compiled sampler leaves the key without a primitive
        mx.clear_cache()
        self.probe()

    def probe(self) -> None:
        """A forward pass and a random (compiled) sample on a one-token prompt."""
        self._tiny_run(temperature=1.0, max_tokens=1)

    def _tiny_run(self, temperature: float, max_tokens: int) -> None:
        gen = Generate(rid="probe", prompt="", sampling=SamplingParams(
            max_tokens=max_tokens, temperature=temperature))
        for _ in self.generate(Prepared(gen, [0])):
            pass
