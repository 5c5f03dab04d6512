"""The runner's admission, dispatch and fault handling, against the in-process fake."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol import Cancel, Generate, SamplingParams
from supervisor.config import Config
from supervisor.http.errors import APIError
from tests.supervisor.errors_seen import raises_api
from supervisor.workers.runner import BROKEN, READY, ModelRunner
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.generates import generate

FAST = dict(restart_backoff=0.01, heartbeat_timeout=1.0, cancel_grace=0.3, queue_timeout=2.0)


def make(world: FakeWorld, **cfg) -> ModelRunner:
    runner = ModelRunner("fake", Config(**{**FAST, **cfg}), world.factory("fake"))
    runner.start()
    return runner


async def collect(handle, timeout=5.0):
    await handle.started(timeout)
    text = []
    async for batch in handle.deltas(time.monotonic() + timeout):
        text += [d.text for d in batch]
    return "".join(text)


async def test_serves_a_request_with_usage_counts():
    world = FakeWorld(FakeBehaviour(tokens=4))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="abc"))
        text = await collect(h)
        assert text == "w1 w2 w3 w4 "
        assert h.done.finish_reason == "stop"
        assert (h.done.prompt_tokens, h.done.completion_tokens) == (3, 4)
        assert runner.state == READY and runner.inflight == {}
    finally:
        await runner.stop()


async def test_crash_mid_stream_fails_started_and_requeues_waiting():
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=50, crash_after_tokens=2)},
                      behaviour=FakeBehaviour(tokens=3))
    runner = make(world)
    try:
        first = runner.submit(generate(prompt="a"))
        second = runner.submit(generate(prompt="b"))
        with raises_api() as err:
            await collect(first)
        assert err.value.status == 503 and "retry" in err.value.message
        assert await collect(second) == "w1 w2 w3 "  # served by the next incarnation
        assert runner.restarts == 1 and runner.epoch == 2
        # The waiting request had been sent ahead (prefetch), never started, and went
        # down again to the next incarnation under a new rid.
        gens = [m for m in world.received if isinstance(m, Generate)]
        assert [g.prompt for g in gens] == ["a", "b", "b"]
        assert gens[1].rid.endswith("-1") and gens[2].rid.endswith("-2")
        assert runner.restart_causes["crash"] == 1
    finally:
        await runner.stop()


@pytest.mark.parametrize("tokens_first,doing", [(0, "reading the prompt"), (2, "generating")])
async def test_a_death_says_whether_the_request_had_output_yet(tokens_first, doing):
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=50, crash_after_tokens=tokens_first)},
                      behaviour=FakeBehaviour(tokens=3))
    runner = make(world)
    try:
        with raises_api() as err:
            await collect(runner.submit(generate(prompt="a")))
        assert f"stopped while {doing} (exited with code 1)" in err.value.message
    finally:
        await runner.stop()


async def test_dispatched_but_not_started_is_requeued_after_death():
    # Epoch 1 dies 50 ms after Ready while the first request runs; the second request
    # was never started and must survive on epoch 2.
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=100, step_s=0.01, die_after_ready_s=0.05)},
                      behaviour=FakeBehaviour(tokens=2))
    runner = make(world)
    try:
        a = runner.submit(generate(prompt="a"))
        b = runner.submit(generate(prompt="b"))
        with raises_api():
            await collect(a)
        assert await collect(b) == "w1 w2 "
        assert b.attempt == 2  # sent ahead to epoch 1, never started there: sent again
    finally:
        await runner.stop()


async def test_hung_worker_is_killed_by_heartbeat_timeout_and_replaced():
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=50, hang_after_tokens=1)},
                      behaviour=FakeBehaviour(tokens=2))
    runner = make(world, heartbeat_timeout=0.3)
    try:
        with raises_api():
            await collect(runner.submit(generate(prompt="a")))
        assert await collect(runner.submit(generate(prompt="b"))) == "w1 w2 "
        assert runner.restart_causes["heartbeat"] == 1
    finally:
        await runner.stop()


class Clock:
    """Time the test moves by hand (the runner's injected clock)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def ticks(runner: ModelRunner, n: int = 3) -> None:
    """Let the liveness monitor look `n` times."""
    await asyncio.sleep(n * runner.MONITOR_INTERVAL + 0.05)


async def test_an_idle_worker_given_work_is_not_hung_before_its_first_step():
    """The hang clock starts when an idle worker is given work: its last step, however
    long ago, is not a hang. (The race an outside tester saw: the first request after
    `--hang-timeout` of idleness killed the worker within 100 ms.) Its start (the
    prefill) takes longer than one look of the monitor, so the monitor sees it busy
    without progress."""
    clock = Clock()
    world = FakeWorld(FakeBehaviour(tokens=2, start_s=4 * ModelRunner.MONITOR_INTERVAL))
    runner = ModelRunner("fake", Config(**{**FAST, "heartbeat_timeout": 10_000,
                                             "hang_timeout": 5}), world.factory("fake"),
                         clock=clock)
    runner.start()
    try:
        assert await runner.wait_ready(5)
        clock.now += 100  # idle far past the hang timeout
        await ticks(runner)
        assert await collect(runner.submit(generate(prompt="a"))) == "w1 w2 "
        assert runner.restarts == 0 and runner.epoch == 1
        # ... and a worker that makes no progress once busy is still hung.
        world.default.start_s = 10.0
        h = runner.submit(generate(prompt="b"))
        await ticks(runner, 1)
        clock.now += 6
        with raises_api() as err:
            await h.started(5)
        assert err.value.status == 503 and runner.restart_causes["hung"] == 1
    finally:
        await runner.stop()


async def test_ignored_cancel_is_killed_after_grace():
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=1000, ignore_cancel=True)},
                      behaviour=FakeBehaviour(tokens=2))
    runner = make(world, cancel_grace=0.2)
    try:
        h = runner.submit(generate(prompt="a"))
        await h.started(2)
        h.cancel()
        assert any(isinstance(m, Cancel) for m in world.received)
        t0 = time.monotonic()
        while runner.epoch < 2 or runner.state != READY:
            await asyncio.sleep(0.02)
            assert time.monotonic() - t0 < 3
        assert runner.restart_causes["cancel"] == 1
        assert await collect(runner.submit(generate(prompt="b"))) == "w1 w2 "
    finally:
        await runner.stop()


async def test_crash_loop_marks_broken_and_refuses():
    world = FakeWorld(FakeBehaviour(die_after_ready_s=0.0))
    runner = make(world, crash_budget=2, crash_window=60)
    try:
        t0 = time.monotonic()
        while runner.state != BROKEN:
            await asyncio.sleep(0.02)
            assert time.monotonic() - t0 < 5
        assert runner.epoch == 3 and "crash loop" in runner.last_error
        with raises_api() as err:
            runner.submit(generate(prompt="x"))
        assert err.value.status == 503 and "crash loop" in err.value.message
    finally:
        await runner.stop()


async def test_load_error_is_broken_at_once_with_its_message():
    world = FakeWorld(FakeBehaviour(load_error="model X is not in the cache"))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="x"))
        with raises_api() as err:
            await h.started(3)
        assert err.value.status == 503 and "not in the cache" in err.value.message
        assert runner.state == BROKEN and runner.epoch == 1
    finally:
        await runner.stop()


async def test_queue_full_and_queue_timeout_are_503_with_retry_after():
    world = FakeWorld(FakeBehaviour(tokens=1000, step_s=0.01))
    runner = make(world, max_queue=1, queue_timeout=0.2)
    try:
        running = runner.submit(generate(prompt="a"))
        await running.started(2)
        waiting = runner.submit(generate(prompt="b"))  # on the worker at once, prepared, waiting
        assert runner.dispatch.waiting() == 1 and not runner.queue
        with raises_api() as full:
            runner.submit(generate(prompt="c"))         # --max-queue counts it wherever it waits
        assert full.value.status == 503 and "Retry-After" in full.value.headers
        with raises_api() as late:
            await waiting.started(0.2)
        assert late.value.status == 503 and "Retry-After" in late.value.headers
        assert any(isinstance(m, Cancel) and m.rid == waiting.rid for m in world.received)
        assert all(g.prompt != "c" for g in world.received if isinstance(g, Generate))
        runner.submit(generate(prompt="d")).cancel()    # its place is free again
    finally:
        await runner.stop()


async def test_request_timeout_cancels_and_is_504():
    world = FakeWorld(FakeBehaviour(tokens=1000, step_s=0.01))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="a"))
        await h.started(2)
        with raises_api() as err:
            async for _ in h.deltas(time.monotonic() + 0.1):
                pass
        assert err.value.status == 504
        assert any(isinstance(m, Cancel) and m.rid == h.rid for m in world.received)
        t0 = time.monotonic()
        while runner.inflight:  # the worker answers the cancel with Done
            await asyncio.sleep(0.01)
            assert time.monotonic() - t0 < 2
    finally:
        await runner.stop()


async def test_context_error_from_worker_maps_to_400():
    world = FakeWorld(FakeBehaviour(context_length=10))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="abcdef", max_tokens=8))
        with raises_api() as err:
            await h.started(2)
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    finally:
        await runner.stop()


async def test_cancelling_a_queued_request_never_reaches_the_worker():
    world = FakeWorld(FakeBehaviour(tokens=30, step_s=0.01))
    runner = make(world)
    try:
        a = runner.submit(generate(prompt="a"))
        b = runner.submit(generate(prompt="b"))
        b.cancel()
        assert b.finished and b.done.finish_reason == "cancelled"
        await collect(a)
        assert [g.prompt for g in world.received if isinstance(g, Generate)] == ["a"]
    finally:
        await runner.stop()


async def test_quiet_stream_yields_pings_then_the_text():
    # A long prefill: nothing for a while; deltas(idle=...) yields [] so the handler
    # can write `: ping` comments, then the text still arrives whole.
    world = FakeWorld(FakeBehaviour(tokens=2, step_s=0.15))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="a"))
        await h.started(2)
        batches = [b async for b in h.deltas(time.monotonic() + 5, idle=0.05)]
        assert [] in batches
        assert "".join(d.text for b in batches for d in b) == "w1 w2 "
    finally:
        await runner.stop()


async def test_a_client_too_far_behind_is_cancelled(monkeypatch):
    import supervisor.workers.handle as requests_mod
    monkeypatch.setattr(requests_mod, "MAX_PENDING_EVENTS", 5)
    world = FakeWorld(FakeBehaviour(tokens=1000, step_s=0.001))
    runner = make(world)
    try:
        h = runner.submit(generate(prompt="a"))
        await h.started(2)
        await asyncio.sleep(0.2)  # the handler does not read: events pile up
        assert any(isinstance(m, Cancel) and m.rid == h.rid for m in world.received)
        with raises_api() as err:
            async for _ in h.deltas(time.monotonic() + 5):
                pass
        assert err.value.status == 503 and "too slowly" in err.value.message
    finally:
        await runner.stop()


@pytest.mark.parametrize("bad_request,param", [
    (Generate(rid="", messages=[{"role": "user", "content": "\ud800"}]), "messages"),
    (Generate(rid="", prompt="a", sampling=SamplingParams(seed=2 ** 64)), "seed"),
    (Generate(rid="", prompt="a", template_kwargs={"x": 2 ** 70}), "template_kwargs"),
])
async def test_a_request_that_cannot_be_sent_fails_alone_and_frees_its_slot(bad_request, param):
    world = FakeWorld(FakeBehaviour(tokens=2))
    runner = make(world)
    try:
        assert await runner.wait_ready(5)
        bad = runner.submit(bad_request)
        good = runner.submit(generate(prompt="b"))
        with raises_api() as err:
            await bad.started(1.0)
        assert err.value.status == 400 and err.value.param == param
        assert bad.finished and bad.attempt == 1  # tried once, never re-queued
        assert await collect(good) == "w1 w2 "   # the slot was free at once
        assert runner.inflight == {} and not runner.queue
        assert [m.rid for m in world.received if isinstance(m, Generate)] == [good.rid]
        assert runner.restarts == 0 and runner.state == READY
    finally:
        await runner.stop()


@pytest.mark.parametrize("fields,params,param", [
    ({"prompt": "a", "max_tokens": 129}, None, "max_tokens"),
    ({"messages": [], "max_tokens": 10 ** 6}, {"max_tokens": "max_output_tokens"},
     "max_output_tokens"),
    ({"prompt": "a", "top_k": 1001}, None, "top_k"),
    ({"prompt": "a", "logit_bias": [[5, 1.0], [1000, -1.0]]}, None, "logit_bias"),
])
async def test_integers_beyond_the_models_limits_are_refused_before_queueing(
        fields, params, param):
    world = FakeWorld(FakeBehaviour(tokens=1, context_length=128, vocab_size=1000))
    runner = make(world)
    try:
        assert await runner.wait_ready(5)
        with raises_api() as err:
            runner.submit(generate(**fields), params)
        assert err.value.status == 400 and err.value.param == param
        assert not runner.queue and not runner.inflight
        # The limits themselves are allowed: top_k = vocabulary, the last token id.
        ok = runner.submit(generate(prompt="a", top_k=1000, max_tokens=100,
                                    logit_bias=[[999, 1.0]]))
        assert await collect(ok) == "w1 "
    finally:
        await runner.stop()


async def test_a_worker_over_its_memory_limit_is_recycled_between_requests():
    """Busy, it finishes its request; idle and over --worker-memory-limit, it is replaced
    at once (not as a crash); a worker within the limit is left alone."""
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=30, step_s=0.02, active_bytes=5000)},
                      behaviour=FakeBehaviour(tokens=2, active_bytes=100))
    runner = make(world, worker_memory_limit=1000, restart_backoff=30.0)
    runner.MONITOR_INTERVAL = 0.05
    try:
        h = runner.submit(generate(prompt="a"))
        assert (await collect(h)).count("w") == 30  # not killed while it ran
        deadline = time.monotonic() + 5
        while runner.restart_causes["memory"] == 0:
            assert time.monotonic() < deadline, "an idle worker over its limit was kept"
            await asyncio.sleep(0.05)
        # Respawned at once (no 30 s backoff: not a crash), and the new one is kept.
        assert await collect(runner.submit(generate(prompt="b"))) == "w1 w2 "
        await asyncio.sleep(0.5)
        assert runner.restart_causes == {"memory": 1} and runner.epoch == 2
        assert "recycled" in runner.last_error and "over its" in runner.last_error
    finally:
        await runner.stop()


def test_the_memory_limit_defaults_to_the_gates_reservation_plus_the_prompt_cache():
    runner = ModelRunner("fake", Config(prompt_cache_bytes=1000), FakeWorld().factory("fake"))
    assert runner.memory_limit() is None  # nothing reserved yet: no limit to judge by
    runner.need_bytes = 3000
    assert runner.memory_limit() == 5000
    runner.config = Config(worker_memory_limit=7)
    assert runner.memory_limit() == 7
