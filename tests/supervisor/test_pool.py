"""The pool's model lifecycle against the in-process fake worker: load on request, the
memory gate (evict, wait, 507), LRU eviction, keep-alive, swaps, drain, admin kill."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from supervisor.config import Config
from tests.supervisor.errors_seen import raises_api
from supervisor.memory.probe import CRITICAL, MemoryReading
from supervisor.workers.pool import Pool
from supervisor.workers.report import Health
from supervisor.workers.runner import BROKEN, DRAIN, FORCE, READY
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.generates import generate

GiB = 1 << 30
FAST = dict(restart_backoff=0.01, heartbeat_timeout=2.0, cancel_grace=0.3, queue_timeout=5.0,
            memory_factor=1.0, kv_budget=1000, memory_wait=0.5, keep_alive=0,
            shutdown_timeout=2.0)


class Memory:
    """An OS whose available memory is `capacity` less what ready workers use (their
    estimated need), unless `available` pins it."""

    def __init__(self, capacity: int = 64 * GiB):
        self.capacity = capacity
        self.available: int | None = None
        self.pressure = "normal"
        self.pool: Pool | None = None

    def __call__(self) -> MemoryReading:
        if self.available is not None:
            return MemoryReading(self.available, self.capacity, self.pressure, "test")
        used = sum(r.need_bytes for r in self.pool.all_runners() if r.state in ("ready", "draining"))
        return MemoryReading(self.capacity - used, self.capacity, self.pressure, "test")


def model_dir(root: Path, name: str, weights: int = 10_000) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"max_position_embeddings": 128}')
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weights)  # sparse: the size is what counts
    return str(d)


class Worlds:
    """One FakeWorld per model, made on first use with `behaviour`."""

    def __init__(self, behaviour: FakeBehaviour | None = None):
        self.behaviour = behaviour or FakeBehaviour()
        self.by_model: dict[str, FakeWorld] = {}

    def factory_for(self, model: str):
        world = self.by_model.setdefault(model, FakeWorld(self.behaviour))
        return world.factory(model)


def make_pool(tmp_path, worlds: Worlds, memory: Memory | None = None, **cfg) -> Pool:
    """A pool whose state dir is `tmp_path`, which is also a model root: requests may
    load the models `model_dir(tmp_path, ...)` makes."""
    memory = memory or Memory()
    cfg = {**FAST, "models_dirs": (tmp_path,), **cfg}
    pool = Pool(Config(state_dir=tmp_path, **cfg), worlds.factory_for, probe=memory)
    memory.pool = pool
    pool.start()
    return pool


async def collect(handle, timeout=5.0) -> str:
    """The request's text; waits for its start unless the test already did."""
    if handle.started_msg is None:
        await handle.started(timeout)
    text = []
    async for batch in handle.deltas(time.monotonic() + timeout):
        text += [d.text for d in batch]
    return "".join(text)


async def until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def broken_pinned(tmp_path):
    """(pool, model, runner): a pool whose pinned model ("bad weights") failed to load,
    its runner BROKEN. The caller stops the pool."""
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(load_error="bad weights")))
    runner = pool.add(a, pinned=True)  # --model / mlxctl load: the admin must see it
    try:
        await until(lambda: runner.state == BROKEN)
    except BaseException:
        await pool.stop()
        raise
    return pool, a, runner


async def test_a_request_for_a_local_model_loads_it_and_unknown_names_are_404(tmp_path):
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=2)))
    try:
        runner = await pool.get(a)
        assert await collect(runner.submit(generate(prompt="x"))) == "w1 w2 "
        assert pool.find("a") is runner  # the path's last component is an alias
        assert not runner.pinned  # loaded on request: keep-alive may unload it
        with raises_api() as err:
            await pool.get(str(tmp_path / "nope"))
        assert err.value.status == 404 and err.value.code == "model_not_found"
    finally:
        await pool.stop()


async def test_load_on_request_can_be_switched_off(tmp_path):
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(), allow_load_on_request=False)
    try:
        with raises_api() as err:
            await pool.get(a)
        assert err.value.status == 404 and not pool.runners
    finally:
        await pool.stop()


async def test_gate_refuses_with_507_saying_need_and_free(tmp_path):
    a = model_dir(tmp_path, "a", weights=3 * GiB)
    memory = Memory()
    memory.available = 1 * GiB
    pool = make_pool(tmp_path, Worlds(), memory, memory_wait=0.3)
    try:
        h = (await pool.get(a)).submit(generate(prompt="x"))
        t0 = time.monotonic()
        with raises_api() as err:
            await h.started(5)
        assert time.monotonic() - t0 >= 0.3  # it waited for memory before refusing
        e = err.value
        assert e.status == 507 and e.code == "insufficient_memory"
        assert "3.0 GiB" in e.message and "1.0 GiB is available" in e.message
        assert pool.find(a) is None and "a" in pool.last_refusal  # forgotten: may retry
    finally:
        await pool.stop()


async def test_gate_waits_for_memory_to_appear_then_loads(tmp_path):
    a = model_dir(tmp_path, "a", weights=3 * GiB)
    memory = Memory()
    memory.available = 1 * GiB
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), memory, memory_wait=5)
    try:
        runner = await pool.get(a)
        h = runner.submit(generate(prompt="x"))
        await until(lambda: runner.state == "waiting")
        await asyncio.sleep(0.3)
        assert runner.state == "waiting" and runner.link is None  # nothing spawned yet
        memory.available = 8 * GiB
        assert await collect(h) == "w1 "
        assert runner.need_bytes == 3 * GiB + 1000
    finally:
        await pool.stop()


async def test_critical_pressure_refuses_whatever_the_bytes(tmp_path):
    a = model_dir(tmp_path, "a")
    memory = Memory()
    memory.pressure = CRITICAL
    pool = make_pool(tmp_path, Worlds(), memory, memory_wait=0.2)
    try:
        h = (await pool.get(a)).submit(generate(prompt="x"))
        with raises_api() as err:
            await h.started(5)
        assert err.value.status == 507
    finally:
        await pool.stop()


async def test_memory_short_evicts_the_least_recently_used_idle_model(tmp_path):
    a, b, c = (model_dir(tmp_path, n, weights=4 * GiB) for n in "abc")
    worlds = Worlds(FakeBehaviour(tokens=1))
    pool = make_pool(tmp_path, worlds, Memory(capacity=9 * GiB))
    try:
        await collect((await pool.get(a)).submit(generate(prompt="x")))
        await collect((await pool.get(b)).submit(generate(prompt="x")))
        await collect((await pool.get(a)).submit(generate(prompt="y")))  # a is now the most recent
        assert await collect((await pool.get(c)).submit(generate(prompt="x"))) == "w1 "
        assert set(pool.runners) == {a, c}  # b, least recently used, made room
        assert worlds.by_model[b].links[0].closed
    finally:
        await pool.stop()


async def test_max_models_evicts_lru_idle_and_refuses_when_all_are_busy(tmp_path):
    a, b, c = (model_dir(tmp_path, n) for n in "abc")
    worlds = Worlds(FakeBehaviour(tokens=1000, step_s=0.01))
    pool = make_pool(tmp_path, worlds, max_models=1, memory_wait=0.3)
    try:
        long = (await pool.get(a)).submit(generate(prompt="x"))
        await long.started(5)
        # a is busy: b cannot take its slot, and is refused once --memory-wait passes.
        hb = (await pool.get(b)).submit(generate(prompt="x", max_tokens=1))
        with raises_api() as err:
            await hb.started(5)
        assert err.value.status == 503 and "--max-models" in err.value.message
        long.cancel()
        await until(lambda: pool.find(a).is_idle())
        # Now a is idle: c evicts it.
        assert await collect((await pool.get(c)).submit(generate(prompt="x", max_tokens=2))) == "w1 w2 "
        assert list(pool.runners) == [c]
    finally:
        await pool.stop()


async def test_keep_alive_unloads_idle_on_request_models_but_not_pinned_ones(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), keep_alive=0.3)
    try:
        pinned = pool.add(a, pinned=True)
        await collect((await pool.get(b)).submit(generate(prompt="x")))
        t_used = time.monotonic()
        await until(lambda: pool.find(b) is None, timeout=3)
        assert time.monotonic() - t_used >= 0.3 - 0.01  # t_used is taken just after the Done
        assert pool.find(a) is pinned and pinned.state == READY
    finally:
        await pool.stop()


async def test_swap_drain_finishes_in_flight_on_the_old_model(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    worlds = Worlds(FakeBehaviour(tokens=30, step_s=0.01))
    pool = make_pool(tmp_path, worlds)
    try:
        old = pool.add(a, pinned=True)
        running = old.submit(generate(prompt="x"))
        queued = old.submit(generate(prompt="y", max_tokens=3))
        await running.started(5)
        result = await pool.swap(b, DRAIN)
        assert result.replaced == [a] and result.model == b
        assert len(await collect(running)) > 0 and running.done.finish_reason == "stop"
        assert await collect(queued) == "w1 w2 w3 "  # served by the model it named
        assert list(pool.runners) == [b] and pool.find(b).pinned  # took a's place
        assert old.state == "stopped" and worlds.by_model[a].links[0].closed
    finally:
        await pool.stop()


async def test_swap_force_fails_in_flight_cleanly_and_still_serves_the_queued(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    worlds = Worlds(FakeBehaviour(tokens=1000, step_s=0.01))
    pool = make_pool(tmp_path, worlds, models_dirs=())  # a and b lie outside the roots
    try:
        pool.add(a, pinned=True)
        running = (await pool.get(a)).submit(generate(prompt="x"))
        queued = (await pool.get(a)).submit(generate(prompt="y", max_tokens=2))
        await running.started(5)
        await pool.swap(b, FORCE)
        with raises_api() as err:
            await collect(running)
        assert err.value.status == 503 and "unloaded" in err.value.message
        # The queued request named `a`: it is served by a worker of `a`, loaded again
        # (the admin had loaded `a`: the model roots bind only what requests load).
        assert await collect(queued) == "w1 w2 "
        assert set(pool.runners) == {a, b}
        with raises_api() as err:  # a new request still may not load it
            await pool.unload(a)
            await pool.get(a)
        assert err.value.status == 404
    finally:
        await pool.stop()


async def test_swap_to_a_model_that_cannot_load_keeps_the_old_one(tmp_path):
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b", weights=100 * GiB)
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), memory_wait=0.2)
    try:
        old = pool.add(a, pinned=True)
        await old.wait_ready(5)
        with raises_api() as err:
            await pool.swap(b, DRAIN)
        assert err.value.status == 507
        assert pool.find(a) is old and old.state == READY
    finally:
        await pool.stop()


async def test_a_swap_that_needs_the_old_models_memory_retires_it_first(tmp_path):
    a, b = model_dir(tmp_path, "a", 5 * GiB), model_dir(tmp_path, "b", 5 * GiB)
    worlds = Worlds(FakeBehaviour(tokens=1))
    pool = make_pool(tmp_path, worlds, Memory(capacity=8 * GiB))
    try:
        old = pool.add(a, pinned=True)
        await old.wait_ready(5)
        await pool.swap(b, DRAIN)
        assert list(pool.runners) == [b] and pool.find(b).state == READY
        assert old.state == "stopped"
    finally:
        await pool.stop()


async def test_drain_lets_running_requests_finish_and_refuses_new_ones(tmp_path):
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=20, step_s=0.01)))
    try:
        runner = pool.add(a, pinned=True)
        h = runner.submit(generate(prompt="x"))
        await h.started(5)
        drained = asyncio.create_task(pool.drain(5))
        await asyncio.sleep(0)
        with raises_api() as err:
            runner.submit(generate(prompt="late"))
        assert err.value.status == 503 and "shutting down" in err.value.message
        assert await drained is True
        assert h.done.finish_reason == "stop" and h.done.completion_tokens == 20
    finally:
        await pool.stop()


async def test_drain_gives_up_after_its_timeout(tmp_path):
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=10_000, step_s=0.01)))
    try:
        h = pool.add(a, pinned=True).submit(generate(prompt="x"))
        await h.started(5)
        t0 = time.monotonic()
        assert await pool.drain(0.2) is False
        assert 0.2 <= time.monotonic() - t0 < 1.0
        pool.begin_shutdown()
        with raises_api() as err:
            await collect(h)
        assert "shutting down" in err.value.message
    finally:
        await pool.stop()


async def test_admin_kill_ends_running_requests_and_respawns_without_counting_a_crash(tmp_path):
    a = model_dir(tmp_path, "a")
    worlds = Worlds(FakeBehaviour(tokens=1000, step_s=0.01))
    pool = make_pool(tmp_path, worlds, crash_budget=0)
    try:
        runner = pool.add(a, pinned=True)
        h = runner.submit(generate(prompt="x"))
        await h.started(5)
        waiting = runner.submit(generate(prompt="y", max_tokens=2))
        out = await pool.kill(a)
        assert out == {"model": a, "cancelled": 1, "restarted": True}
        with raises_api() as err:
            await collect(h)
        assert "killed" in err.value.message
        assert await collect(waiting) == "w1 w2 "  # queued: served by the new worker
        assert runner.epoch == 2 and runner.state == READY  # crash_budget=0 not tripped
        assert runner.restart_causes == {"admin": 1}
    finally:
        await pool.stop()


async def test_admin_kill_without_restart_unloads(tmp_path):
    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1000, step_s=0.01)))
    try:
        runner = pool.add(a, pinned=True)
        h = runner.submit(generate(prompt="x"))
        await h.started(5)
        queued = runner.submit(generate(prompt="y"))
        await pool.kill(a, restart=False)
        assert pool.find(a) is None and runner.state == "stopped"
        for handle in (h, queued):
            with raises_api():
                await collect(handle)
    finally:
        await pool.stop()


async def test_unload_of_a_broken_model_and_health_while_idle(tmp_path):
    pool, a, runner = await broken_pinned(tmp_path)
    try:
        report = pool.health()
        assert report.state is Health.UNAVAILABLE and "bad weights" in report.reason
        await pool.unload(a)
        report = pool.health()
        assert report.state is Health.IDLE and report.workers == []  # loads on request
        assert report.reason == "no model loaded; models load on request"
    finally:
        await pool.stop()
