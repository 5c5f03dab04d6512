"""Coding agents on a vision-language checkpoint (issue 33: the models people run agents on
ship as those): the pinned Claude Code (tests/clients/) against the real supervisor and
a vision worker on a tiny Qwen3.5-style checkpoint (hybrid linear-attention layers and a
vision tower, whose cache cannot be trimmed), edited to end each reply after one token
(tests/openresponses/model.py), with a 16K window for the agent's ~11K-token prompt. A
recording proxy shows what it sent and what mlxd answered: each turn reads the turn
before from the prefix cache."""

from __future__ import annotations

import asyncio

import pytest

from tests.clients import cli
from tests.clients.recorder import Recorder
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hybrid_server(models_dir):
    from tests.openresponses.model import build_stopping_model
    from worker.demos.vision import build_vision_model

    source = build_vision_model(models_dir / "tiny-qwen3.5-16k", "tiny", family="qwen3.5",
                                context_length=16384).path
    model = build_stopping_model(source, models_dir / "tiny-qwen3.5-16k-stopping")
    with ServerProcess([str(model)]) as srv:
        srv.wait_healthy(timeout=120)
        srv.model = str(model)
        yield srv


def usage_of(exchange) -> dict:
    """The usage a Messages stream's message_start reported."""
    (start,) = [e for e in exchange.events() if e["type"] == "message_start"]
    return start["message"]["usage"]


@pytest.mark.timeout(600)
async def test_claude_codes_next_turn_reads_the_last_one_from_the_cache(hybrid_server, tmp_path):
    # Claude Code as users run it (its own system prompt and tools, not --bare): it sends
    # its environment as a system message after the first user message, every turn.
    recorder = Recorder(hybrid_server.url, ("/v1/messages",))
    model = hybrid_server.model
    async with recorder.serving() as proxy:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "unused",
               "ANTHROPIC_BASE_URL": proxy, "ANTHROPIC_MODEL": model,
               "ANTHROPIC_SMALL_FAST_MODEL": model,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
        for turn, prompt in enumerate(("Say hello.", "Now name a color.")):
            proc = await asyncio.create_subprocess_exec(
                cli("claude", "CLAUDE_BIN"), "-p", *(["--continue"] if turn else []), prompt,
                "--output-format", "stream-json", "--verbose", cwd=tmp_path, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 240)
            assert proc.returncode == 0, (out + err).decode()[-2000:]
    first, second = recorder.exchanges
    assert first.status == second.status == 200
    assert any(m["role"] == "system" for m in second.request["messages"])  # (the layout)
    was, now = usage_of(first), usage_of(second)
    assert was["cache_read_input_tokens"] == 0 and was["input_tokens"] > 8000
    # The whole first prompt came from the cache (all but the reply's and the new words).
    assert now["cache_read_input_tokens"] >= was["input_tokens"]
    assert now["input_tokens"] < 100
