"""The runner's state machine: the table, and the moves real scenarios make through it."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from supervisor.config import Config
from supervisor.workers import runner as runner_mod
from supervisor.workers.errors import InsufficientMemory
from supervisor.workers.runner import ModelRunner
from supervisor.workers.states import (TRANSITIONS, ExitCause, IllegalTransition, RunnerState,
                                       check)
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.generates import generate
from tests.supervisor.test_runner import FAST, collect

S = RunnerState


@pytest.mark.parametrize("old,new", list(itertools.product(S, S)),
                         ids=lambda s: s.value)
def test_every_pair_is_allowed_exactly_when_the_table_says(old, new):
    if new is old or new in TRANSITIONS[old]:
        assert check(old, new) is new
    else:
        with pytest.raises(IllegalTransition):
            check(old, new)


def test_the_table_is_closed_and_only_stopped_starts_over():
    assert set(TRANSITIONS) == set(S)
    assert all(targets <= set(S) for targets in TRANSITIONS.values())
    assert TRANSITIONS[S.BROKEN] == {S.STOPPED}  # a broken model is replaced, never revived
    assert [s for s, t in TRANSITIONS.items() if S.STARTING in t] == [S.STOPPED, S.WAITING]
    assert str(S.READY) == "ready" and f"{ExitCause.HUNG}" == "hung"


@pytest.fixture
def moves(monkeypatch):
    """Every transition the runner makes, as (old, new)."""
    seen: list[tuple[S, S]] = []

    def recording(old, new):
        out = check(old, new)
        if old is not new:
            seen.append((old, new))
        return out

    monkeypatch.setattr(runner_mod, "check", recording)
    return seen


def make(world, admit=None, **cfg):
    r = ModelRunner("fake", Config(**{**FAST, **cfg}), world.factory("fake"), admit=admit)
    r.start()
    return r


async def until(pred, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


async def test_load_serve_crash_restart_retire(moves):
    world = FakeWorld(per_epoch={1: FakeBehaviour(tokens=20, crash_after_tokens=2)},
                      behaviour=FakeBehaviour(tokens=2))
    r = make(world)
    with pytest.raises(Exception):
        await collect(r.submit(generate(prompt="a")))
    assert await collect(r.submit(generate(prompt="b"))) == "w1 w2 "
    await r.retire("drain", timeout=2, reason="test")
    assert moves == [(S.STOPPED, S.STARTING), (S.STARTING, S.READY), (S.READY, S.RESTARTING),
                     (S.RESTARTING, S.READY), (S.READY, S.DRAINING), (S.DRAINING, S.STOPPED)]
    assert r.restart_causes == {"crash": 1}


async def test_gate_refusal_and_pass(moves):
    async def refuse(_):
        raise InsufficientMemory(2 << 30, 1 << 30)

    refused = make(FakeWorld(), admit=refuse)
    await refused.wait_loaded()
    assert refused.state is S.STOPPED and isinstance(refused.refused, InsufficientMemory)

    async def admit(_):
        return None

    ok = make(FakeWorld(), admit=admit)
    assert await ok.wait_ready(5)
    await ok.stop()
    assert moves == [(S.STOPPED, S.WAITING), (S.WAITING, S.STOPPED),
                     (S.STOPPED, S.WAITING), (S.WAITING, S.STARTING), (S.STARTING, S.READY),
                     (S.READY, S.STOPPED)]


async def test_load_failure_is_broken_then_stopped(moves):
    r = make(FakeWorld(FakeBehaviour(load_error="bad weights")))
    await r.wait_loaded()
    assert r.state is S.BROKEN and "bad weights" in r.last_error
    await r.stop()
    assert moves == [(S.STOPPED, S.STARTING), (S.STARTING, S.BROKEN), (S.BROKEN, S.STOPPED)]


async def test_a_crash_loop_while_serving_is_broken(moves):
    r = make(FakeWorld(FakeBehaviour(die_after_ready_s=0.05)), crash_budget=1)
    await until(lambda: r.state is S.BROKEN)
    await r.stop()
    assert moves[:2] == [(S.STOPPED, S.STARTING), (S.STARTING, S.READY)]
    assert (S.RESTARTING, S.READY) in moves and moves[-2:] == [
        (moves[-2][0], S.BROKEN), (S.BROKEN, S.STOPPED)]
    assert moves[-2][0] in (S.READY, S.RESTARTING)


async def test_retiring_while_loading_turns_ready_into_draining(moves):
    r = make(FakeWorld(FakeBehaviour(load_s=0.3, tokens=2)))
    h = r.submit(generate(prompt="a"))           # queued while the worker loads
    left = await r.retire("drain", timeout=5, reason="test")
    # Draining serves what was accepted: the worker comes up straight into DRAINING.
    assert left == [] and h.done is not None and h.done.finish_reason == "stop"
    assert moves == [(S.STOPPED, S.STARTING), (S.STARTING, S.DRAINING),
                     (S.DRAINING, S.STOPPED)]


async def test_stop_during_restart_backoff(moves):
    r = make(FakeWorld(per_epoch={1: FakeBehaviour(die_after_ready_s=0.05)}),
             restart_backoff=5.0)
    await until(lambda: r.state is S.RESTARTING and r.restarts == 1)
    await r.stop()
    assert moves == [(S.STOPPED, S.STARTING), (S.STARTING, S.READY), (S.READY, S.RESTARTING),
                     (S.RESTARTING, S.STOPPED)]
