"""A worker keeps MLX's buffer cache within what the memory gate admitted it at
(worker/loading/startup.py): the arithmetic, and the limit really set in MLX."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from protocol.models import need_bytes
from worker.loading.startup import bound_memory, cache_limit
from worker.loop.sizing import StepMemory


def test_the_cache_gets_what_the_admitted_size_leaves_after_the_weights_and_the_kv():
    assert cache_limit(admitted=1000, resident=300, kv_budget=500) == 200
    assert cache_limit(admitted=1000, resident=600, kv_budget=500) == 0  # nothing left


def test_the_cache_keeps_at_least_a_decode_steps_buffers_within_the_admitted_size():
    """A decode step's freed buffers (the floor) stay cached when the leftover is smaller,
    the leftover wins when larger, and neither goes above the admitted size less the
    resident memory (the KV budget already counts a step's transients)."""
    assert cache_limit(admitted=1000, resident=300, kv_budget=650, floor=120) == 120
    assert cache_limit(admitted=1000, resident=300, kv_budget=500, floor=120) == 200
    assert cache_limit(admitted=1000, resident=300, kv_budget=700, floor=900) == 700
    assert cache_limit(admitted=1000, resident=1100, kv_budget=0, floor=50) == 0


def test_a_decode_steps_working_memory_is_what_it_frees_if_more_than_its_logits():
    """The KV budget counts a step at the larger of its logits and twice its measured
    freed buffers (`per_row`: room for MLX's loose fit), so the floor of the cache is
    inside the budget."""
    assert StepMemory(0.0, 0.0, 100).decode(4) == 4 * 100 * 12
    assert StepMemory(0.0, 0.0, 100, per_row=5000.0).decode(4) == 40000


def test_the_admitted_size_is_the_gates_own_figure(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert need_bytes(tmp_path, 1.5, 100) == 1600
    assert need_bytes(tmp_path, 1.5, 100, share=(1, 4)) == 475   # a rank of four


def test_bound_memory_sets_mlxs_cache_limit(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    # Whatever MLX memory this test process already holds (earlier tests' arrays) counts
    # as resident: the admitted size is made 64 MiB above it.
    resident = mx.get_active_memory()
    args = SimpleNamespace(memory_factor=1.0, kv_budget=(64 << 20) + resident)
    old = mx.set_cache_limit(1 << 40)
    try:
        limit = bound_memory(tmp_path, args, None)
        assert limit == cache_limit(1000 + args.kv_budget, mx.get_active_memory(), 0)
        assert 0 < limit <= (64 << 20) + 1000
        assert mx.set_cache_limit(old) == limit
        # A batch whose KV budget takes all but 1 MiB, and whose decode step frees 1.5 MiB
        # at its 4 rows: twice the step's buffers are the limit.
        batch = SimpleNamespace(kv_budget=args.kv_budget - (1 << 20), max_size=4,
                                step_memory=StepMemory(0.0, 0.0, 0, per_row=384 << 10))
        assert bound_memory(tmp_path, args, batch) == 3 << 20
        assert mx.set_cache_limit(old) == 3 << 20
    finally:
        mx.set_cache_limit(old)


def test_a_decode_step_frees_what_the_next_one_allocates(tiny_loaded):
    """`StepMemory.freed`: a decode step's buffers, more at a wider batch (its logits
    alone are rows x vocab floats), and the cache limit of the process is left as it was."""
    model = tiny_loaded.model
    old = mx.set_cache_limit(12345)
    try:
        one, eight = StepMemory.freed(model, 1), StepMemory.freed(model, 8)
        assert mx.set_cache_limit(old) == 12345
    finally:
        mx.set_cache_limit(old)
    assert one >= tiny_loaded.vocab_size * 4  # (the logits of its one row, at least)
    assert eight >= 8 * tiny_loaded.vocab_size * 4 and eight > one


def test_a_prefill_chunk_may_borrow_the_devices_free_memory_less_a_margin(monkeypatch):
    """worker/loading/startup.py `device_spare`: a GPU whose free memory MLX reads (CUDA)
    lends a prefill chunk that memory and this process's buffer cache, less a tenth of the
    device; a device that says nothing of it (the CPU, Metal) lends nothing."""
    from worker.loading.startup import SPARE_MARGIN, device_spare

    assert "free_memory" in mx.device_info() or device_spare() is None
    free = [50 << 30]
    monkeypatch.setattr(mx, "device_info", lambda: {"free_memory": free[0],
                                                    "total_memory": 80 << 30})
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 1 << 30)
    spare = device_spare()
    assert spare() == (51 << 30) - int((80 << 30) * SPARE_MARGIN)
    free[0] = 1 << 30  # read again at each call: another process took the rest
    assert spare() == 0


def test_the_first_decode_step_after_a_prefill_makes_room_in_the_cache():
    """worker/loop/sizing.py `CacheRoom`: buffers a prefill left in MLX's cache (here 800 KB
    of one array) are dropped at the first decode-only step when the cache has not room
    for a step's buffers under its limit, kept when it has; buffers freed while decoding
    (a KV cache's outgrown ones) are looked at every CHECK_EVERY decode steps, alike."""
    from worker.loop.sizing import CacheRoom

    def stale(n: int) -> None:
        a = mx.zeros((n // 4,))
        mx.eval(a)
        del a
        mx.synchronize()

    old = mx.set_cache_limit(1 << 20)
    try:
        mx.clear_cache()
        room = CacheRoom()
        room.limit, room.need = 1 << 20, 300_000
        stale(800_000)
        assert mx.get_cache_memory() >= 800_000
        room.decoding()  # no prefill since the last decode step: nothing to make room for
        assert mx.get_cache_memory() >= 800_000
        room.prefilling()
        room.decoding()
        assert mx.get_cache_memory() == 0
        stale(400_000)
        room.prefilling()
        room.decoding()  # 400 KB + a 300 KB step fit under 1 MiB: the prefill's stay
        assert mx.get_cache_memory() >= 400_000
        stale(600_000)  # (freed while decoding, no prefill since: 1 MB now)
        for _ in range(room.CHECK_EVERY - 1):
            room.decoding()
        assert mx.get_cache_memory() >= 1_000_000
        room.decoding()  # the CHECK_EVERY-th: no room for the 150 KB a step frees, cleared
        assert mx.get_cache_memory() == 0
        stale(800_000)
        for _ in range(room.CHECK_EVERY):
            room.decoding()
        assert mx.get_cache_memory() >= 800_000  # (room for a step's frees: kept)
    finally:
        mx.set_cache_limit(old)
        mx.clear_cache()
