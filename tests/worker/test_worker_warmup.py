"""The batch's warm-up before Ready (worker/loop/warmup.py): two short requests, together,
nothing of them cached; on any device, not every width the batch can reach (on a GPU a
worker that had run them decoded one stream 12-16% slower ever after: warmup.py)."""

from __future__ import annotations

import mlx.core as mx

from tests.worker.batchrun import make_batch
from worker.kvcache.prefix import PrefixCache


def _widths(batch) -> list[int]:
    """Record the width of every decode step the batch launches."""
    seen, next_ = [], batch.gen.next

    def recording():
        out = next_()
        gb = getattr(batch.gen, "_generation_batch", None)
        seen.append(len(gb.uids) if gb is not None else 0)
        return out

    batch.gen.next = recording
    return seen


def test_two_short_requests_run_together_and_nothing_of_them_is_cached(engine):
    batch = make_batch(engine, max_size=5, prefix=PrefixCache(1 << 26))
    seen = _widths(batch)
    batch.warm(prompt_tokens=12)
    assert 2 in seen and max(seen) == 2, seen  # (batched decode, both at once)
    assert len(batch) == 0 and batch.reserved == 0
    assert batch.kvcache.prefix.nbytes == 0


def test_where_the_device_is_a_gpu_no_wider_batch_runs(engine, monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    batch = make_batch(engine, max_size=6)
    seen = _widths(batch)
    batch.warm(prompt_tokens=12)
    assert seen and max(seen) == 2, seen
