"""Claude Code (2.1.332, from npm: tests/clients/) end to end on a small-context model until
it compacts the conversation itself: it sends mlxd a summarisation request, starts the
conversation again from the summary mlxd's model wrote, and the turn goes on.

What Claude Code reads for a window (its bundle, checked): a gateway's model it does not
know gets a 1M-token window, and neither the Anthropic Models API's `max_input_tokens`
nor CLAUDE_CODE_MAX_CONTEXT_TOKENS (read only with DISABLE_COMPACT set, which turns
compaction off) changes that. Two ways make it compact within a small window, one test
each, as docs/api.md tells users:
- with no settings, on mlxd's over-context 400 ("prompt is too long: N tokens > M
  maximum"), which it compacts on and retries;
- ahead of the limit: CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000 (its minimum) with
  CLAUDE_AUTOCOMPACT_PCT_OVERRIDE (compact at that share of the window), so no request is
  refused.
A recording proxy between Claude Code and mlxd shows what mlxd was sent and answered. The
model is the tiny one that ends each reply after one token (`stopping_server`, shared with
the Open Responses cases), with an 8,192-token window: Claude Code's summarisation prompt
alone is ~4,300 tokens of the tiny tokenizer. --bare, a one-line system prompt and no
tools keep each turn small and fast; every turn is a `claude -p --continue` of the same
session.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.clients import cli
from tests.clients.recorder import Exchange, Recorder
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

CONTEXT = 8192  # stopping_server's window


def notes(n: int) -> str:
    """A turn's text: about 31 tokens of the tiny tokenizer a note."""
    return " ".join(f"note{i} says the river flows past hill {i * 7}." for i in range(n))


def user_texts(x: Exchange) -> list[str]:
    """The text of each user message of a Messages request."""
    return [c if isinstance(c, str) else "".join(b.get("text", "") for b in c)
            for c in (m["content"] for m in x.request["messages"] if m["role"] == "user")]


def reply(x: Exchange) -> str:
    """The text mlxd streamed back."""
    return "".join(e["delta"].get("text", "") for e in x.events()
                   if e["type"] == "content_block_delta")


def message_id(x: Exchange) -> str:
    return x.events()[0]["message"]["id"]


async def claude_session(server: ServerProcess, tmp_path, turns: int, size: int,
                         **env) -> tuple[Recorder, list, str]:
    """Runs up to `turns` turns of `size` notes each, of one Claude Code session through a
    Recorder, until a turn compacts; returns the recorder, that turn's stream-json events
    and its prompt."""
    recorder = Recorder(server.url, ("/v1/messages",))
    model = server.model
    async with recorder.serving() as proxy:
        base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "unused",
                "ANTHROPIC_BASE_URL": proxy,
                "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
        for turn in range(1, turns + 1):
            prompt = f"Turn {turn}. {notes(size)}"
            proc = await asyncio.create_subprocess_exec(
                cli("claude", "CLAUDE_BIN"), "-p", *(["--continue"] if turn > 1 else []),
                "--bare", "--tools", "", "--system-prompt", "Answer briefly.",
                "--output-format", "stream-json", "--verbose", prompt,
                cwd=tmp_path, env={**base, **env}, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 240)
            assert proc.returncode == 0, (out + err).decode()[-2000:]
            events = [json.loads(line) for line in out.decode().splitlines()]
            if any(e.get("subtype") == "compact_boundary" for e in events):
                return recorder, events, prompt
    raise AssertionError(f"no compaction in {turns} turns")


def assert_compacted_and_went_on(recorder: Recorder, events: list, prompt: str) -> None:
    """Claude Code compacted automatically through mlxd and the turn went on from the
    summary mlxd's model wrote."""
    (boundary,) = [e for e in events if e.get("subtype") == "compact_boundary"]
    assert boundary["compact_metadata"]["trigger"] == "auto"
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success"
    assert not result["is_error"]
    # Its summarisation requests (it asks again once when a reply has no <summary> tags).
    asked = [i for i, x in enumerate(recorder.exchanges) if "<summary>" in user_texts(x)[-1]]
    assert asked, "Claude Code sent no summarisation request"
    summaries = [reply(recorder.exchanges[i]) for i in asked
                 if recorder.exchanges[i].status == 200]
    assert summaries and all(summaries)
    after = recorder.exchanges[asked[-1] + 1:]
    assert after and all(x.status == 200 for x in after)
    went_on = after[-1]
    texts = user_texts(went_on)
    assert "continued from a previous conversation" in texts[0]
    assert any(summary in texts[0] for summary in summaries)  # what mlxd's model wrote
    assert "Turn 1. " not in "".join(texts)  # the first turn was compacted away
    assert texts[-1].endswith(prompt)  # the turn that compacted goes on after the summary
    answered = [e for e in events if e["type"] == "assistant"][-1]
    assert answered["message"]["id"] == message_id(went_on)  # mlxd's reply to the turn


@pytest.mark.timeout(600)
async def test_claude_code_compacts_on_mlxds_context_error(stopping_server, tmp_path):
    # About 2,500 tokens a turn: the fourth passes the window.
    recorder, events, prompt = await claude_session(stopping_server, tmp_path, turns=6,
                                                    size=80)
    refused = [x for x in recorder.exchanges if x.status == 400]
    assert refused, "the window was never passed"
    error = refused[0].error()
    assert error["message"].startswith("prompt is too long: ")
    assert error["message"].endswith(f" > {CONTEXT} maximum")
    assert_compacted_and_went_on(recorder, events, prompt)


@pytest.mark.timeout(600)
async def test_claude_code_compacts_ahead_of_the_window_when_told(stopping_server, tmp_path):
    # 1.5% of the 100,000-token minimum: compact past 1,500 tokens, which Claude Code
    # checks before the third turn. Turns of about 1,250 tokens keep its summarisation
    # request (the first two and ~4,300 tokens of instructions) within the window.
    recorder, events, prompt = await claude_session(
        stopping_server, tmp_path, turns=4, size=40, CLAUDE_CODE_AUTO_COMPACT_WINDOW="100000",
        CLAUDE_AUTOCOMPACT_PCT_OVERRIDE="1.5")
    assert all(x.status == 200 for x in recorder.exchanges)  # mlxd refused nothing
    assert_compacted_and_went_on(recorder, events, prompt)
