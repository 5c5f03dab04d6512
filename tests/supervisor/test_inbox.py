"""The Inbox between the runner's event reader and a request's handler: a stream waits on it
once per worker message, so a wait is one future and one timer, cancelled when an item
wakes it (issue 36: asyncio.wait_for added a future, a callback and a partial per wait);
it still wakes on an item, times out, and survives its task's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.workers.handle import Inbox


@pytest.fixture
async def timers(monkeypatch):
    """The timers the running loop schedules, and asyncio.wait_for made to fail."""
    made = []
    loop = asyncio.get_running_loop()
    call_later = loop.call_later

    def spy(*args, **kw):
        made.append(call_later(*args, **kw))
        return made[-1]

    monkeypatch.setattr(loop, "call_later", spy)

    def no_wait_for(*a, **kw):
        raise AssertionError("Inbox.wait used asyncio.wait_for")

    monkeypatch.setattr(asyncio, "wait_for", no_wait_for)
    return made


async def test_a_wait_is_one_timer_cancelled_by_the_item_that_wakes_it(timers):
    box = Inbox()
    loop = asyncio.get_running_loop()
    loop.call_soon(box.put, "a")
    assert await box.wait(30.0) is True
    assert len(timers) == 1 and timers[0].cancelled()  # (not left in the loop for 30 s)
    assert await box.wait(30.0) is True and len(timers) == 1  # an item there: no wait
    assert box.popleft() == "a" and len(box) == 0


async def test_a_wait_times_out_and_a_late_item_is_kept(timers):
    box = Inbox()
    assert await box.wait(0.01) is False
    assert await box.wait(0) is False and len(timers) == 1
    box.put("late")  # no waiter left: kept for the next wait
    assert await box.wait(5.0) is True and box.drain() == ["late"]


async def test_a_cancelled_wait_leaves_no_waiter_and_no_timer(timers):
    box = Inbox()
    task = asyncio.ensure_future(box.wait(30.0))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timers[0].cancelled() and box._waiter is None
    box.put("x")
    assert len(box) == 1
