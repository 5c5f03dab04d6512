"""opencode (1.18.33, from npm: tests/clients/) end to end against mlxd's chat completions,
configured as README.md tells users: its opencode block is read from README.md here, so
a README whose config no longer works fails this test.

What opencode sends (recorded here, through tests/clients/recorder.py): every request
asks for `max_tokens` = the model's `limit.output` from its config, and without a limit
32,000, which a model whose context is smaller refuses as OpenAI does (a 400); so the
README's config carries `limit`. On mlxd's `context_length_exceeded` error opencode
compacts the conversation (a summarisation request without its tools) and goes on from
the summary. Its agent prompt (about 9,500 characters and ten tools) is ~2,200 tokens of
the real demo model's tokenizer (and ~14,000 of the tiny test models' byte-level one,
beyond their windows): so the real model, served with its context capped at 3,072 tokens
(a long message passes it quickly) and replies capped by the config's `limit.output`.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from tests.clients import cli
from tests.clients.recorder import Exchange, Recorder
from tests.realmodel import serving_demo

pytestmark = pytest.mark.integration

README = Path(__file__).parents[2] / "README.md"
CONTEXT = 3072   # the server's --max-context-tokens
OUTPUT = 32      # the config's limit.output: each reply's cap, kept short for the CPU


@pytest.fixture(scope="module")
def capped_demo(smollm2_gguf, tmp_path_factory):
    with serving_demo(smollm2_gguf, tmp_path_factory, "--max-context-tokens",
                      str(CONTEXT)) as srv:
        yield srv


def readme_config() -> dict:
    """The opencode.json that README.md gives."""
    section = README.read_text().split("### opencode", 1)[1]
    return json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))


def config_for(base_url: str, context: int) -> dict:
    """README's config pointed at `base_url`, its model's limits this test's."""
    config = readme_config()
    (provider,) = config["provider"].values()
    provider["options"]["baseURL"] = f"{base_url}/v1"
    (model,) = provider["models"].values()
    model["limit"] = {"context": context, "output": OUTPUT}
    return config


def reply(x: Exchange) -> str:
    """The text mlxd streamed back."""
    return "".join((c.get("delta") or {}).get("content") or "" for e in x.events()
                   for c in e.get("choices") or [])


class Session:
    """One opencode session through a Recorder, in its own home and project directory."""

    def __init__(self, server, tmp_path: Path):
        self.server, self.tmp = server, tmp_path
        self.recorder = Recorder(server.url, ("/v1/chat/completions",))
        self.work = tmp_path / "work"
        self.work.mkdir()

    async def turn(self, proxy: str, text: str, first: bool) -> tuple[int, list[dict]]:
        """`opencode run` of `text` (continuing the session after the first): its exit
        code and its JSON events."""
        config = self.tmp / "opencode.json"
        config.write_text(json.dumps(config_for(proxy, CONTEXT)))
        (provider,) = readme_config()["provider"]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.tmp), "OPENCODE_CONFIG": str(config),
               "XDG_CONFIG_HOME": str(self.tmp / "config"),
               "XDG_DATA_HOME": str(self.tmp / "data"), "XDG_CACHE_HOME": str(self.tmp / "cache"),
               "XDG_STATE_HOME": str(self.tmp / "state"),
               "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
               "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
               "OPENCODE_DISABLE_CLAUDE_CODE": "1"}
        proc = await asyncio.create_subprocess_exec(
            cli("opencode", "OPENCODE_BIN"), "run", *([] if first else ["--continue"]),
            "--model", f"{provider}/demo", "--format", "json", text,
            cwd=self.work, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 240)
        events = [json.loads(line) for line in out.decode().splitlines()
                  if line.startswith("{")]
        assert events, (out + err).decode()[-2000:]
        return proc.returncode, events


def content(message: dict) -> str:
    """A chat message's text, whether a string or text parts."""
    c = message.get("content") or ""
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)


def texts(events: list[dict]) -> list[str]:
    """The reply texts opencode showed (not its own synthetic parts)."""
    return [e["part"]["text"] for e in events
            if e["type"] == "text" and not e["part"].get("synthetic")]


def test_readme_config_names_the_models_window_and_a_reply_cap(real_server):
    (provider,) = readme_config()["provider"].values()
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    (model_id, model), = provider["models"].items()
    served = real_server.get("/v1/models")[1]["data"]
    assert [m["context_length"] for m in served if m["id"] == model_id] == \
        [model["limit"]["context"]]  # the context README names is the model's own
    assert 0 < model["limit"]["output"] < model["limit"]["context"]


@pytest.mark.timeout(600)
async def test_opencode_turns_with_the_readme_config(capped_demo, tmp_path):
    session = Session(capped_demo, tmp_path)
    async with session.recorder.serving() as proxy:
        rc, first = await session.turn(proxy, "Say hi.", first=True)
        assert rc == 0, first
        rc, second = await session.turn(proxy, "Name one color.", first=False)
        assert rc == 0, second
    sent = session.recorder.exchanges
    assert sent and all(x.status == 200 for x in sent)
    assert {x.request["max_tokens"] for x in sent} == {OUTPUT}  # the config's limit.output
    agent = [x for x in sent if x.request.get("tools")]  # (not its title request)
    assert len(agent) == 2
    # What opencode showed is what mlxd streamed, and its next turn sends it back.
    assert texts(first) == [reply(agent[0])] and texts(second) == [reply(agent[1])]
    history = agent[1].request["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert history[2]["content"] == reply(agent[0])
    # The second turn resumed from the first's prefix; opencode read that from usage.
    usage = json.loads(agent[1].body.decode().split("data: ")[-2])["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    (finish,) = [e for e in second if e["type"] == "step_finish"]
    assert cached > 2000 and finish["part"]["tokens"]["cache"]["read"] == cached


@pytest.mark.timeout(600)
async def test_opencode_compacts_on_mlxds_context_error_and_goes_on(capped_demo, tmp_path):
    session = Session(capped_demo, tmp_path)
    long = " ".join(f"Note {i}: the river flows past hill {i * 7}." for i in range(90))
    async with session.recorder.serving() as proxy:
        rc, _ = await session.turn(proxy, "Say hi.", first=True)
        assert rc == 0
        # opencode exits 1 after a turn that met an error, even one it recovered from.
        _, events = await session.turn(proxy, f"{long} Which hill comes first?", first=False)
    sent = session.recorder.exchanges
    refused = [i for i, x in enumerate(sent) if x.status == 400]
    assert refused, "the window was never passed"
    error = sent[refused[0]].error()
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    # opencode read mlxd's error as the window passed, not as a failure to retry.
    assert [e["error"]["name"] for e in events if e["type"] == "error"][0] == \
        "ContextOverflowError"
    # It summarised (a request without its tools, answered), then went on from mlxd's
    # summary within the window.
    summaries = [x for x in sent[refused[0]:] if not x.request.get("tools") and x.status == 200]
    assert summaries and all(reply(x) for x in summaries)
    went_on = sent[-1]
    assert went_on.status == 200 and went_on.request.get("tools")
    history = [content(m) for m in went_on.request["messages"]]
    assert any(reply(summaries[-1]) in c for c in history)
    assert not any(long in c for c in history)
    assert texts(events)[-1] == reply(went_on)
