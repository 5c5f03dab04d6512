"""mlxd's text engine and batch in this process, as a worker builds them (no HTTP, no
worker process), for the benchmarks that set them beside raw mlx-lm (bench/gpu.py's `Raw`):
`in_process` builds them, `greedy` prepares a request of token ids, `Seq` is what the
batch needs of the scheduler's Sequence, and `time_methods` wraps methods with timers.
"""

from __future__ import annotations

import time
from pathlib import Path


class Seq:
    """What worker/loop/batch.py needs of the scheduler's Sequence."""

    def __init__(self, rid: str):
        self.rid = rid
        self.uid = None


def in_process(path: Path, *, max_size: int = 32, prefill_batch: int = 8,
               prompt_cache: int = 8 << 30, prefill_step: int = 2048, max_draft: int = 8,
               kv_bits: int | None = None):
    """mlxd's text engine and a batch on the model at `path`, as a worker builds them
    (the prefix cache included, `prompt_cache` bytes; 0: none; `max_draft` 0: no
    speculation at all, as `--max-draft-tokens 0`; `kv_bits`: --kv-bits, groups of 64)."""
    from worker.loading import models
    from worker.loop.batch import Batch
    from worker.loop.sizing import KVSize
    from worker.text.engine import TextEngine
    from worker.kvcache.manager import KVCache, trimmable
    from worker.kvcache.prefix import PrefixCache
    from worker.kvcache.quantized import KVFormat

    loaded = models.load(str(path), Path(path).parent)
    eng = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, prefill_step,
                     loaded.vocab_size)
    fmt = KVFormat.of(kv_bits)
    if fmt.quantized:  # (as the worker's load: the attention path this device runs)
        fmt.check(eng.model, None, getattr(getattr(eng.model, "args", None), "model_type", ""))
    batch = Batch(eng, max_size=max_size, prefill_step=prefill_step,
                  prefill_batch=prefill_batch, kv_budget=32 << 30,
                  kvcache=KVCache(PrefixCache(prompt_cache),
                                  trimmable=trimmable(eng.model, None)) if prompt_cache else None,
                  kv=KVSize.measure(eng.model, None, fmt), kv_format=fmt,
                  max_draft=max_draft)
    if batch.speculation is not None:  # (as a worker prices it at load: once a model here)
        from worker.loading.startup import price_verification
        prices = _PRICES.setdefault(str(path), {})
        if max_draft not in prices:
            price_verification(batch, eng)
            prices[max_draft] = batch.speculation.verify_price
        batch.speculation.verify_price = prices[max_draft]
    return eng, batch


_PRICES: dict = {}  # model path -> {max_draft: its verification's price} (in_process)


def greedy(eng, rid: str, ids: list[int], tokens: int):
    """A prepared greedy request for `ids`, as the worker prepares a Generate."""
    from protocol import Generate, SamplingParams, pack_ids

    return eng.prepare(Generate(rid=rid, prompt_ids=pack_ids(ids),
                                sampling=SamplingParams(max_tokens=tokens, temperature=0.0)))


def time_methods(targets, sink) -> None:
    """Wrap methods so that each call's wall time goes to `sink(label, seconds)`, label
    "Owner.name": how the probes see where a step's time goes. `targets`: (owner, names)
    pairs (a class, or a module such as mlx.core). Not undone: for a probe's own process."""
    import functools

    for owner, names in targets:
        for name in names:
            fn = getattr(owner, name)
            label = f"{getattr(owner, '__name__', owner)}.{name}".replace("mlx.core.", "mx.")

            @functools.wraps(fn)
            def timed(*args, _fn=fn, _label=label, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*args, **kw)
                finally:
                    sink(_label, time.perf_counter() - t)
            setattr(owner, name, timed)
