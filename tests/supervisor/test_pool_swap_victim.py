"""What the memory gate unloads to make room (pool.py `_victim`, `_eviction_could_help`):
a swap unloads the model it replaces before any other (the least recently used idle model
is the victim of last resort, and a swap must not take a model it was not asked to
replace); an eviction that frees exactly enough is made, then the gate looks again,
with or without a pressure level from the OS; under critical pressure any idle model goes;
and --memory-budget counts the models already loaded."""

from __future__ import annotations

import pytest

from supervisor.memory.probe import CRITICAL
from supervisor.workers.runner import DRAIN, READY
from tests.generates import generate
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.errors_seen import raises_api
from tests.supervisor.test_pool import GiB, Memory, Worlds, collect, make_pool, model_dir


async def served(pool, path: str):
    """The runner of `path`, loaded on request and having answered one request."""
    runner = await pool.get(path)
    assert await collect(runner.submit(generate(prompt="x"))) == "w1 "
    return runner


async def test_a_swap_unloads_what_it_replaces_not_the_least_recently_used(tmp_path):
    keep = model_dir(tmp_path, "keep", 4 * GiB)
    old = model_dir(tmp_path, "old", 4 * GiB)
    new = model_dir(tmp_path, "new", 6 * GiB)
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), Memory(capacity=12 * GiB))
    try:
        kept = await served(pool, keep)
        replaced = await served(pool, old)
        assert kept.last_used < replaced.last_used and kept.evictable  # the LRU idle one
        result = await pool.swap(new, DRAIN, replace=[old])
        assert result.replaced == [old]
        assert set(pool.runners) == {keep, new} and pool.find(new).state == READY
        assert kept.state == READY and replaced.state == "stopped"
    finally:
        await pool.stop()


@pytest.mark.parametrize("pressure", ["normal", None])  # None: the OS gives no level
async def test_an_eviction_that_frees_exactly_the_need_is_made(tmp_path, pressure):
    a = model_dir(tmp_path, "a", 4 * GiB)
    b = model_dir(tmp_path, "b", 6 * GiB)
    # kv_budget 1000 each: b needs 6 GiB + 1000, and 2 GiB free + a's 4 GiB + 1000 is that.
    memory = Memory(capacity=6 * GiB + 1000)
    memory.pressure = pressure
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), memory, memory_wait=0.3)
    try:
        first = await served(pool, a)
        second = await served(pool, b)
        assert list(pool.runners) == [b] and first.state == "stopped"
        assert second.need_bytes == 6 * GiB + 1000  # admitted by the gate, once room was made
    finally:
        await pool.stop()


async def test_under_critical_pressure_idle_models_are_unloaded_first(tmp_path):
    """Critical pressure refuses every load, but the gate unloads what is idle before it
    gives up (the bytes say nothing then: any unload may relieve it)."""
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    memory = Memory()
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), memory, memory_wait=0.2)
    try:
        first = await served(pool, a)
        memory.pressure = CRITICAL
        with raises_api() as err:
            await (await pool.get(b)).submit(generate(prompt="x")).started(5)
        assert err.value.status == 507
        assert first.state == "stopped" and not pool.runners
    finally:
        await pool.stop()


async def test_the_memory_budget_counts_the_models_already_loaded(tmp_path):
    a, b = model_dir(tmp_path, "a", 4 * GiB), model_dir(tmp_path, "b", 4 * GiB)
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), Memory(capacity=64 * GiB),
                     memory_budget=6 * GiB)
    try:
        first = await served(pool, a)
        second = await served(pool, b)
        # Plenty of memory, but both would be 8 GiB of a 6 GiB budget: a made room.
        assert list(pool.runners) == [b] and first.state == "stopped"
    finally:
        await pool.stop()
