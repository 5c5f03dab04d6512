"""What a batch's sequences and steps take: the sizes worker/loop/batch.py admits by.

`KVSize` is one sequence's KV memory (a fixed part for recurrent state and a part per
token, a sliding window's up to its size); `StepMemory` a step's working memory (a prefill
chunk's activations, measured on the device at load, and the logits at the batch's
width); `ChunkSizer` the prefill chunk by time. Apart from the batch, which only reads
them, so that a benchmark or a test sizes a sequence without a generator.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from worker.kvcache.quantized import KVFormat

# The smallest prefill chunk a tight KV budget may bring a chunk down to.
MIN_CHUNK = 32


@dataclass
class KVSize:
    """KV memory of one sequence: a fixed part (recurrent state) plus a part per token
    (attention keys and values), up to `window` tokens for a rotating cache
    (--max-kv-size: every layer), and each sliding-window layer's part per token up to
    its own window (`windows`: Gemma 3 and 4, gpt-oss, whose windows would otherwise be
    counted as if they grew with the context: on Gemma 3, five layers in six)."""
    per_token: float
    per_sequence: int = 0
    window: Optional[int] = None
    windows: tuple = ()   # (bytes per token, window in tokens) of each sliding layer

    def of(self, tokens: int) -> int:
        if self.window is not None:
            tokens = min(tokens, self.window)
        return int(self.per_sequence + self.per_token * tokens
                   + sum(per * min(tokens, size) for per, size in self.windows))

    def tokens_within(self, nbytes: int) -> int:
        """The longest sequence whose KV fits in `nbytes` (any, where nothing grows past
        a window)."""
        bound = self.window if self.window is not None else \
            max((size for _, size in self.windows), default=0) if self.per_token <= 0 else None
        if bound is not None:
            return 1 << 62 if self.of(bound) <= nbytes else self._search(nbytes, bound)
        return self._search(nbytes, max(0, int((nbytes - self.per_sequence) // self.per_token)))

    def _search(self, nbytes: int, hi: int) -> int:
        """The largest t <= hi with of(t) <= nbytes (of grows with t)."""
        lo = 0
        if self.of(0) > nbytes:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.of(mid) <= nbytes else (lo, mid - 1)
        return lo

    @classmethod
    def measure(cls, model, window: Optional[int] = None,
                kv_format: KVFormat = KVFormat(), tokens: int = 1) -> "KVSize":
        """From the shapes of a cache after a forward pass of `tokens`: attention layers
        hold (batch, heads, allocated tokens, dim) keys and values (quantized: packed
        integers, scales and biases), a sliding window's up to its size; anything else
        (recurrent state) is per sequence."""
        cache = kv_format.make(model)
        model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
        per_token, fixed, windows = 0.0, 0, []
        for layer in _flat(cache):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is not None and values is not None:
                arrays = [*keys, *values] if isinstance(keys, (tuple, list)) else [keys, values]
                per = sum(a.nbytes for a in arrays) / arrays[0].shape[2]
                if isinstance(layer, RotatingKVCache):
                    windows.append((per, layer.max_size))
                else:
                    per_token += per
            else:
                fixed += layer.nbytes
        return cls(per_token, fixed, window, tuple(windows))


@dataclass
class StepMemory:
    """Working memory of one batched step beyond the KV it keeps. A prefill chunk of c
    tokens after o cached ones takes `per_token` x c (the layers' activations) plus
    `per_pair` x c x (c + o) (attention scores, where the backend materializes them: a
    long chunk's scores outweigh its KV); a decode step, three float32 rows of the
    vocabulary per sequence (logits, log-probabilities, processed logits), or what one
    decode step was measured to free per row (`per_row`, at the batch's full width), if
    more: the buffers MLX's cache must hold between steps (worker/loading/startup.py
    `cache_limit`) are then inside the KV budget."""
    per_token: float
    per_pair: float
    vocab: int
    per_row: float = 0.0

    def prefill(self, rows: int, chunk: int, offset: int = 0) -> int:
        return int(rows * chunk * (self.per_token + self.per_pair * (chunk + offset)))

    def logits(self, rows: int) -> int:
        return rows * self.vocab * 4 * 3

    def decode(self, rows: int) -> int:
        """A decode step's working memory at `rows` rows, and what MLX's buffer cache must
        be able to hold for it: twice what it frees, because MLX serves a request from a
        cached buffer up to twice its size, so a cache in use holds more than one step
        from empty frees (with a limit of exactly the freed bytes, one buffer of six
        still went back to the system each step; with 1.5 x, none)."""
        return max(self.logits(rows), int(2 * rows * self.per_row))

    @classmethod
    def measure(cls, model, vocab: int, short: int = 32, long: int = 128,
                kv_format: KVFormat = KVFormat(), readings: int = 3,
                rows: int = 0) -> "StepMemory":
        """From MLX's peak over prefills of two lengths, less the KV they leave: the
        linear and the quadratic part of a chunk's working memory. The largest of a few
        readings: where the backend frees buffers on its own thread (MLX's CPU stream),
        a busy machine frees some early and the peak reads low (a 32-token prefill's
        working memory read 8 KB to 98 KB on two busy cores), which the difference
        of the two lengths turned into a per-token cost of 0; such a pair is read again,
        up to three times (the test suite's busy machine read one so). `rows`: also what
        a decode step of that many rows frees (`freed`), per row; 0: not measured. One full
        collection, then the collector held off through every reading and each reading
        preceded by a collection of the young generation only (what the readings left): a
        full collection before each of the seven took 0.13 s on a worker's heap (90% of a
        tiny model's measurement) and 0.6 s on a test process's."""
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            w_short = w_long = 0.0
            for _ in range(3):  # (again while the per-token part reads 0: read early)
                w_short = max(w_short, max(cls.working(model, short, kv_format, collect=1)
                                           for _ in range(readings)) / short)
                w_long = max(w_long, max(cls.working(model, long, kv_format, collect=1)
                                         for _ in range(readings)) / long)
                per_pair = max(0.0, (w_long - w_short) / (long - short))
                if w_short > per_pair * short:
                    break
            per_row = cls.freed(model, rows, kv_format, collect=1) / rows if rows > 0 else 0.0
        finally:
            if collecting:
                gc.enable()
        return cls(max(0.0, w_short - per_pair * short), per_pair, vocab, per_row)

    @staticmethod
    def freed(model, rows: int, kv_format: KVFormat = KVFormat(), context: int = 4,
              collect: int = 2) -> int:
        """The bytes one decode step of `rows` rows (after `context` tokens each) frees:
        what MLX's buffer cache holds after the step, from empty and with no limit, once
        everything but the KV is dropped. That is what the next step allocates again
        (its activations, logits, log-probabilities, the sampled tokens and the ids fed
        in), so a cache limit below it sends buffers back to the system every token and
        the next step asks for them again (on CUDA a cudaMallocAsync, or for host-made
        arrays a cudaMallocManaged, each; on the CPU a malloc that maps fresh pages).
        At least peak minus active: at the step's peak its live transients came from the
        cache or the system, and at its end they are all in the cache. The second of two
        steps (the first pays one-time costs). Attention scores grow with the context where
        the backend materializes them (MLX's CPU); at a few tokens they are small, as they
        are at any length where attention is fused (Metal, CUDA). `collect`: the oldest
        generation collected first (measure collects all once, then the young)."""
        gc.collect(collect)
        collecting = gc.isenabled()
        gc.disable()
        old = mx.set_cache_limit(1 << 50)
        try:
            cache = kv_format.make(model)
            mx.eval(model(mx.zeros((rows, context), dtype=mx.int32), cache=cache))
            mx.eval([c.state for c in cache])

            def step(cache) -> None:
                logits = model(mx.zeros((rows, 1), dtype=mx.int32), cache=cache)[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                mx.eval(mx.argmax(logprobs, axis=-1), logprobs)

            step(cache)
            mx.synchronize()
            mx.clear_cache()
            step(cache)
            mx.synchronize()  # (the CPU stream frees a step's buffers on its own thread)
            held = mx.get_cache_memory()
            del cache
        finally:
            mx.set_cache_limit(old)
            if collecting:
                gc.enable()
        mx.clear_cache()
        return held

    @staticmethod
    def working(model, n: int, kv_format: KVFormat = KVFormat(), collect: int = 2) -> int:
        """MLX's peak over a prefill of `n` tokens from scratch, less the KV it leaves.
        From an empty buffer cache: a cached buffer bigger than an allocation asks for
        counts whole, so a reading after other work depended on what the cache held
        (after a 2,000-token prefill, the per-token part came out 0 in two runs of three).
        With Python's cycle collector held off: arrays it freed mid-reading lowered the
        active memory the peak is taken against (per-token 0, or 200 x, after other work
        left cyclic garbage holding arrays). `collect` as freed's."""
        gc.collect(collect)
        mx.clear_cache()
        collecting = gc.isenabled()
        gc.disable()
        try:
            cache = kv_format.make(model)
            mx.reset_peak_memory()
            model(mx.zeros((1, n), dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            held = mx.get_peak_memory() - mx.get_active_memory()  # (the KV stays)
            del cache
        finally:
            if collecting:
                gc.enable()
        mx.clear_cache()
        return max(0, held)


class CacheRoom:
    """Room in MLX's buffer cache for the decode steps that follow a prefill.

    MLX caches a freed buffer only while the cache is under its limit, evicts nothing to
    make room, and reuses a cached buffer only for a request of at least half its size
    (mlx/backend/common/buffer_cache.h, the CPU and CUDA allocators). A prefill's freed
    buffers (its chunk's activations, of other sizes) can fill the cache and stay: the
    decode steps' own then go back to the system each step, however large the floor
    (worker/loading/startup.py `cache_limit`). Measured on the CPU with the floor and a
    16-token prefill before: 2 buffers of 16 KB or more allocated anew each decode step;
    with the cache cleared at the first decode-only step, none. So the first step with
    no prompt left to prefill clears the cache if it has not room for `need` (a step's
    buffers at full width); a prefill that left room keeps its buffers for the next one.
    Decoding fills it too: each time a sequence's KV outgrows its buffers (every
    DECODE_STEP or 256 tokens) the old ones are freed, of a size never asked for again,
    and at a long context a few growths fill the cache. Counted on the CPU
    (`python -m bench.buffer_churn`: the 0.5B shape, a 64 MiB limit, one stream decoding
    700 tokens after 2,000): allocations of 256 KB or more a step, by 100 steps, 2.2 0.0
    0.0 2.3 2.0 1.1 1.0 1.0 (the logits' buffers, anew each step from the second growth
    on, until mlx-lm's clear every 512 steps); so every CHECK_EVERY decode steps the
    cache is cleared if it has not room for what one step frees (half of `need`: a cache
    at the floor holding the steps' own buffers has): 2.2 0.0 0.0 0.8 0.0 0.7 0.0 0.0,
    the growths' own new buffers (48 at each) and the steps until the next look.
    `limit`: the cache limit set (None: not bounded by the worker, nothing done)."""

    CHECK_EVERY = 16  # decode-only steps between looks at the cache's room

    def __init__(self) -> None:
        self.limit: Optional[int] = None
        self.need = 0
        self._prefilled = False
        self._steps = 0

    def prefilling(self) -> None:
        self._prefilled = True

    def decoding(self) -> None:
        self._steps += 1
        if self._prefilled or self._steps >= self.CHECK_EVERY:
            room = self.need if self._prefilled else self.need // 2
            self._prefilled, self._steps = False, 0
            if self.limit is not None and mx.get_cache_memory() + room > self.limit:
                mx.clear_cache()


def _flat(cache):
    for c in cache:
        inner = getattr(c, "caches", None)
        if inner is not None:
            yield from _flat(inner)
        else:
            yield c


def prompts_for_step(gen, chunk: int, least: int, most: int) -> int:
    """How many prompts mlx-lm's BatchGenerator `gen` prefills together at its next step
    (its `prefill_batch_size`): those in progress, then the waiting ones in order while
    the step's forward, every prompt right-padded to its widest (each at most a
    `chunk`), stays within `least` chunks' positions, the work `--prefill-batch-size`
    long prompts bring, and at most twice the positions its prompts hold (a longer one
    among short ones waits for the next step rather than pad them all: on a
    compute-bound device padding is work); never fewer than `least`, nor more than
    `most` (the batch). Long prompts still go `least` at a time; short ones that arrive
    together are prefilled in one step and join the batch together, where `least` a
    step made eight 22-token prompts on a lent H200 wait 0.2-1.8 s for their first
    tokens (a 2b Gemma 4; 0.4-0.8 s eight a step: docs/benchmarks.md, session 11)."""
    n, widest, held = 0, 0, 0
    for segments in [c[0] for c in gen._currently_processing]:
        tokens = min(chunk, sum(len(s) for s in segments))
        n, widest, held = n + 1, max(widest, tokens), held + tokens
    for seq in gen._unprocessed_sequences:
        tokens = min(chunk, sum(len(s) for s in seq[1]))
        padded = (n + 1) * max(widest, tokens)
        if n >= most or (n >= least and (padded > least * chunk
                                         or padded > 2 * (held + tokens))):
            break
        n, widest, held = n + 1, max(widest, tokens), held + tokens
    return max(least, min(n, most))


class ChunkSizer:
    """Prefill chunk size by time, not a fixed token count.

    A fixed chunk is wrong on every machine but one: small on a GPU (a 512-token chunk of
    a small model takes milliseconds, and its per-chunk overhead halves prefill speed),
    and cancel and the running streams wait for a whole chunk however long it takes.
    So the size grows while a step with prefill stays under the target time and halves
    when one takes over twice that, between `--prefill-step` and `largest` (mlx-lm's
    default 2048, or --prefill-step if larger): running streams wait at most about two
    targets per token, and prefill runs at the engine's speed where steps are fast. It
    grows by the largest power of two that the step's time allows under the target (at
    least 2), not by doubling: a worker's first long prompt on a GPU, whose 512-token
    chunk takes a few ms, then goes 512 + 1488 in two steps rather than 512 + 1024 + 464
    in three (each step a forward pass's launch and a wait)."""

    def __init__(self, smallest: int, largest: int, target: float = 0.1):
        self.smallest = max(1, smallest)
        self.largest = max(self.smallest, largest)
        self.target = target
        self.size = self.smallest

    def observe(self, seconds: float) -> int:
        """The size for the next step, after a step with prefill took `seconds`."""
        if seconds < self.target and self.size < self.largest:
            grow = 2
            while seconds * grow * 2 <= self.target and self.size * grow < self.largest:
                grow *= 2
            self.size = min(self.largest, self.size * grow)
        elif seconds > 2 * self.target and self.size > self.smallest:
            self.size = max(self.smallest, self.size // 2)
        return self.size
