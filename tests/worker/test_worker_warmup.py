"""The batch's warm-up before Ready (worker/loop/warmup.py): on a GPU every width the batch
can reach runs once, growing and shrinking; on the CPU only the two short requests."""

from __future__ import annotations

from tests.worker.batchrun import make_batch
from worker.kvcache.prefix import PrefixCache
from worker.loop import warmup


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


def test_every_width_up_to_the_batchs_size_runs_joining_and_leaving(engine):
    batch = make_batch(engine, max_size=5, prefix=PrefixCache(1 << 26))
    seen = _widths(batch)
    batch.warm(prompt_tokens=12, widths=5)
    assert set(range(1, 6)) <= set(seen), seen
    top = seen.index(5)
    assert {1, 2, 3, 4} <= set(seen[top:]), seen  # and narrowing again, one a step
    assert len(batch) == 0 and batch.reserved == 0
    assert batch.kvcache.prefix.nbytes == 0  # nothing of it cached


def test_on_the_cpu_only_the_two_short_requests_run(engine):
    batch = make_batch(engine, max_size=5)
    seen = _widths(batch)
    batch.warm(prompt_tokens=12)
    assert seen and max(seen) <= 2, seen


def test_on_a_gpu_every_width_runs_by_default(engine, monkeypatch):
    monkeypatch.setattr(warmup, "compiles_per_shape", lambda: True)
    batch = make_batch(engine, max_size=4)
    seen = _widths(batch)
    batch.warm(prompt_tokens=12)
    assert set(range(1, 5)) <= set(seen), seen


def test_no_more_join_than_the_kv_budget_admits(engine):
    batch = make_batch(engine, max_size=6)
    batch.kv_budget = batch.holds([8 + 7] * 3)  # three of the warm-up's requests
    seen = _widths(batch)
    warmup.warm_widths(batch, 6)
    assert max(seen) == 3, seen
    assert len(batch) == 0
