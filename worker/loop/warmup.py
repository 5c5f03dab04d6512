"""Warming the batch before the worker says it is ready.

A GPU compiles kernels, and plans its matrix products, the first time it meets a shape:
seconds for the first request, and tens of ms for each batch width the first time it
runs. Measured on an H200 (docs/benchmarks.md, Gemma 4 2b): a step where a sequence
joined or left took 83-85 ms the first time its width ran, ~48 ms after, so 8 streams
arriving one a step decoded at 0.50 of the same streams added at once, and a server that
had seen the widths ran 1.8 x faster. So the batch runs, before Ready: two short
requests (chunked prefill, batched decode, the move between them) and, on a GPU, every
width up to its size, growing and shrinking. The CPU's kernels do not depend on the
batch's shape: there only the two requests run (tests start hundreds of workers).

Nothing of it is cached: the prompt cache is set aside while it runs.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import mlx.core as mx

from protocol.messages import Generate, SamplingParams, pack_ids


class _Warm:
    """A stand-in for the scheduler's Sequence."""

    def __init__(self, rid: str):
        self.rid, self.uid = rid, None


def _request(rid: str, ids: list, max_tokens: int) -> Generate:
    return Generate(rid=rid, prompt_ids=pack_ids(ids),
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def compiles_per_shape() -> bool:
    """Whether the device compiles kernels by shape: a GPU (Metal, CUDA), not the CPU."""
    return mx.default_device() == mx.gpu


def warm(batch, prompt_tokens: int = 48, widths: Optional[int] = None) -> None:
    """The two short requests; then, where `widths` (default: the batch's size on a GPU,
    0 on the CPU) exceeds what they ran, every width up to it (`warm_widths`)."""
    vocab = batch.engine.vocab_size
    ids = [1 + i % (vocab - 1) for i in range(prompt_tokens)]
    run_uncached(batch, [_request(f"warm-{n}", ids_, 2)
                         for n, ids_ in enumerate((ids, ids[: prompt_tokens // 2]))])
    if widths is None:
        widths = batch.max_size if compiles_per_shape() else 0
    if min(widths, batch.max_size) > 2:
        warm_widths(batch, min(widths, batch.max_size))


def warm_widths(batch, n: int, prompt_tokens: int = 8) -> None:
    """Widths 1 to `n` each run a decode step, growing and then shrinking: one short
    request joins a step, each with a budget of n + 1 tokens, so the i-th leaves at about
    step i + n + 1, one a step (a greedy request may end sooner at its end token; widths
    it skips on the way up are run on the way down). No more join than the KV budget
    admits."""
    vocab = batch.engine.vocab_size
    with _uncached(batch):
        for i in range(n):
            gen = _request(f"warm-width-{i}",
                           [1 + (7 * i + j) % (vocab - 1) for j in range(prompt_tokens)], n + 1)
            prep = batch.engine.prepare(gen)
            if not batch.fits(prep):
                break
            batch.add(_Warm(gen.rid), prep)
            batch.step()


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
