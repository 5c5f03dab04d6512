"""Coding agents on a vision-language checkpoint (issue 33: the models people run agents on
ship as those), against the real supervisor and a vision worker on a tiny Qwen3.5-style
checkpoint (hybrid linear-attention layers and a vision tower, whose cache cannot be
trimmed), edited to end each reply after one token (tests/openresponses/model.py), with a
16K window for an agent's ~11K-token prompt: the pinned Claude Code (tests/clients/),
through a recording proxy, whose next turn reads the turn before from the prefix cache;
and Codex's session start as the official SDK's WebSocket sends it (what Codex sends,
logged through a proxy: its timing on this CPU, where it sometimes gives up on the
warm-up, is its own), whose turn reads the warm-up's prompt from the cache."""

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


async def test_codexs_warm_up_serves_the_turn_that_adds_a_developer_message(hybrid_server):
    """What Codex sends on a session's start (logged through a proxy from the pinned
    Codex): a warm-up (`generate: false`) of its instructions as a developer message,
    with its tools; then the turn, continuing it, with another developer message and the
    user's. Both developer messages join the leading system message, so the turn's
    prompt parts from the warm-up's where the instructions end: the worker keeps the
    state there, and the turn reads all of it from the cache (on this checkpoint, whose
    cache cannot be trimmed, it read only a periodic state's 8,192 of ~11,000)."""
    import openai

    model = hybrid_server.model
    instructions = "You are Codex, a coding agent. " + "Read before you edit. " * 700
    tools = [{"type": "function", "name": "shell", "description": "Run a command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                             "required": ["cmd"]}}]
    client = openai.AsyncOpenAI(base_url=hybrid_server.url + "/v1", api_key="unused",
                                max_retries=0)

    def developer(text):
        return {"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": text}]}

    async with client.responses.connect() as conn:
        await conn.send({"type": "response.create", "model": model, "store": False,
                         "generate": False, "tools": tools, "input": [developer(instructions)]})
        async for event in conn:
            if event.type == "response.completed":
                warm = event.response
                break
        await conn.send({"type": "response.create", "model": model, "store": False,
                         "tools": tools, "previous_response_id": warm.id,
                         "input": [developer("<permissions>read-only</permissions>"),
                                   {"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": "Say hello."}]}]})
        async for event in conn:
            if event.type == "response.completed":
                turn = event.response
                break
    assert warm.usage.input_tokens > 8192 + 1000  # (past the periodic state)
    assert turn.usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens - 16
