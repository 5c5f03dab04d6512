"""The memory gate counts loads that are admitted but still starting: the OS does not show
their memory as used yet, so without the reservation two loads that each fit alone would
both be admitted (supervisor/workers/pool.py `_reserved`, supervisor/memory/gate.py)."""

from __future__ import annotations

from supervisor.workers.runner import READY, STARTING
from tests.generates import generate
from tests.supervisor.errors_seen import raises_api
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.supervisor.test_pool import GiB, Memory, Worlds, collect, make_pool, model_dir, until


def _slow_first(behaviour: FakeBehaviour, slow: str) -> Worlds:
    """Worlds where the model `slow` takes a minute to load and the others `behaviour`."""
    worlds = Worlds(behaviour)
    worlds.by_model[slow] = FakeWorld(FakeBehaviour(load_s=60))
    return worlds


async def test_a_load_still_starting_keeps_its_memory_from_the_next_one(tmp_path):
    a = model_dir(tmp_path, "a", weights=3 * GiB)
    b = model_dir(tmp_path, "b", weights=3 * GiB)
    memory = Memory(capacity=5 * GiB)  # each fits alone, not both
    pool = make_pool(tmp_path, _slow_first(FakeBehaviour(tokens=1), a), memory,
                     memory_wait=0.2)
    try:
        first = await pool.get(a)
        await until(lambda: first.state == STARTING)
        assert memory().available_bytes == 5 * GiB  # the OS shows nothing used yet
        assert pool._reserved(None) == first.need_bytes == 3 * GiB + 1000
        second = await pool.get(b)
        with raises_api() as err:
            await second.submit(generate(prompt="x")).started(5)
        assert err.value.status == 507 and err.value.code == "insufficient_memory"
        assert "2.0 GiB is available" in err.value.message  # 5 GiB less the reservation
        assert first.state == STARTING and pool.find(b) is None
    finally:
        await pool.stop()


async def test_once_ready_the_reservation_ends_and_memory_decides(tmp_path):
    """The reservation is for loads in flight only: a ready model's memory is the OS's to
    report, and counting it twice would refuse a load that fits."""
    a = model_dir(tmp_path, "a", weights=3 * GiB)
    b = model_dir(tmp_path, "b", weights=3 * GiB)
    memory = Memory(capacity=8 * GiB)
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), memory, memory_wait=0.2)
    try:
        first = await pool.get(a)
        assert await collect(first.submit(generate(prompt="x"))) == "w1 "
        assert first.state == READY and pool._reserved(None) == 0
        second = await pool.get(b)
        assert await collect(second.submit(generate(prompt="x"))) == "w1 "
        assert first.state == READY  # both fit: nothing was evicted
    finally:
        await pool.stop()
