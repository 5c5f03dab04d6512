"""Warming the batch before the worker says it is ready.

A GPU compiles kernels, and plans its matrix products, the first time it meets a shape:
seconds for the first request. So the batch runs two short requests before Ready
(chunked prefill, batched decode, the move between them); nothing of them is cached (the
prompt cache is set aside while they run).

Not every width the batch can reach, though sessions 8-24 did that on a GPU: a width's
first step there costs tens of ms once (a 2b Gemma 4 on an H200: 83-85 ms against ~48
after), but a worker that had run widths 1 to 32 at load decoded one stream at 0.84-0.88
x raw mlx-lm afterwards, against 1.01-1.02 x for the same server warmed with the two
requests only (three runs on a lent H200, the 0.5B shape, --max-batch-size 32, 40
paired rounds each: docs/benchmarks.md, session 25; 8 widths, the default batch: 0.95-0.97
against 1.01). Where in MLX's CUDA backend that cost lives is not known (a larger CUDA
graph cache did not remove it); a width's first step is paid once, the other on every
token after.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from protocol.messages import Generate, SamplingParams, pack_ids


class _Warm:
    """A stand-in for the scheduler's Sequence."""

    def __init__(self, rid: str):
        self.rid, self.uid = rid, None


def _request(rid: str, ids: list, max_tokens: int) -> Generate:
    return Generate(rid=rid, prompt_ids=pack_ids(ids),
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def warm(batch, prompt_tokens: int = 48) -> None:
    """The two short requests, the second half the first's prompt, together."""
    vocab = batch.engine.vocab_size
    ids = [1 + i % (vocab - 1) for i in range(prompt_tokens)]
    run_uncached(batch, [_request(f"warm-{n}", ids_, 2)
                         for n, ids_ in enumerate((ids, ids[: prompt_tokens // 2]))])


def run_uncached(batch, gens: list) -> None:
    """Run `gens` through `batch` together to their end, nothing of them cached."""
    with _uncached(batch):
        for gen in gens:
            batch.add(_Warm(gen.rid), batch.engine.prepare(gen))


@contextlib.contextmanager
def _uncached(batch):
    """The prompt cache set aside while requests are added; then they run to their end,
    and the cache comes back, MLX's buffer cache emptied of their buffers."""
    kvcache, batch.kvcache = batch.kvcache, None
    try:
        yield
        while len(batch):
            batch.step()
    finally:
        batch.kvcache = kvcache
    mx.clear_cache()
