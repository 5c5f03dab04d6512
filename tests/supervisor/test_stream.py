"""The one request lifecycle every surface uses (api/lifecycle.py), on the fake worker."""

from __future__ import annotations

import pytest

from supervisor.api.lifecycle import Generation
from tests.supervisor.errors_seen import raises_api
from tests.supervisor.fakes import FakeBehaviour, FakeWorld
from tests.generates import generate
from tests.supervisor.test_runner import make


async def test_started_parts_and_done():
    runner = make(FakeWorld(FakeBehaviour(tokens=3, step_s=0.01)))
    try:
        gen = Generation(runner.submit(generate(prompt="abc")), queue_timeout=5, request_timeout=5)
        with pytest.raises(RuntimeError):
            async for _ in gen.parts():
                pass
        started = await gen.started()
        assert started.prompt_tokens == 3
        out = await gen.collect()
        assert out.content == "w1 w2 w3 " and gen.done.finish_reason == "stop"
        assert gen.done.completion_tokens == 3
        gen.close()  # idempotent after the end: nothing to cancel
        assert not gen.handle.cancel_requested
    finally:
        await runner.stop()


async def test_quiet_streams_yield_none_for_pings_and_timeouts_raise():
    runner = make(FakeWorld(FakeBehaviour(tokens=1000, step_s=0.3)))
    try:
        gen = Generation(runner.submit(generate(prompt="a")), queue_timeout=5, request_timeout=0.8)
        await gen.started()
        seen = []
        with raises_api() as err:
            async for part in gen.parts(idle=0.1):
                seen.append(part)
        assert None in seen and any(p is not None for p in seen)
        assert err.value.status == 504 and gen.handle.cancel_requested
    finally:
        await runner.stop()
