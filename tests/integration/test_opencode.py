"""opencode (1.18.33, from npm: tests/clients/) end to end against mlxd, configured as
README.md tells users: its opencode block is read from README.md here, so a README whose
config no longer works fails this test. README's provider speaks chat completions (the
AI SDK's openai-compatible package); the same provider through the SDK's OpenAI package
speaks the Responses API (with the session's id as `prompt_cache_key`) and through its
Anthropic package the Messages API: each is driven for two turns.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.clients import cli
from tests.clients.recorder import Exchange, Recorder
from tests.realmodel import serving_demo

pytestmark = pytest.mark.integration

README = Path(__file__).parents[2] / "README.md"
README_NPM = "@ai-sdk/openai-compatible"  # (chat completions)
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


def config_for(base_url: str, context: int, npm: str = README_NPM) -> dict:
    """README's config pointed at `base_url`, its model's limits this test's; with another
    of opencode's AI SDK packages (`npm`: OpenAI's, which speaks the Responses API, or
    Anthropic's, the Messages API), the same provider through it."""
    config = readme_config()
    (provider,) = config["provider"].values()
    provider["options"]["baseURL"] = f"{base_url}/v1"
    if npm != README_NPM:
        provider["npm"] = npm
        provider["options"]["apiKey"] = "unused"  # (those packages want one)
    (model,) = provider["models"].values()
    model["limit"] = {"context": context, "output": OUTPUT}
    # Greedy, so each run's replies are the same: none empty, one after another (opencode
    # sends its agents' temperature to a model that says it takes one).
    model["temperature"] = True
    config["agent"] = {a: {"temperature": 0} for a in ("build", "title", "compaction")}
    return config


def text_of(content) -> str:
    """A message's text, whether a string or parts (text, output_text, text blocks)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


@dataclass(frozen=True)
class Surface:
    """How one of mlxd's APIs carries what the test reads: the request's path and the
    field that caps the reply, the reply's text, the conversation sent ((role, text) of
    each message but the system prompt) and the prompt tokens the answer says were cached."""
    path: str
    cap: str
    reply: Callable[[Exchange], str]
    history: Callable[[dict], list[tuple[str, str]]]
    cached: Callable[[Exchange], int]


def _ended(x: Exchange) -> dict:
    """The response of a Responses stream's last event (incomplete: the reply's cap)."""
    (done,) = [e for e in x.events()
               if e.get("type") in ("response.completed", "response.incomplete")]
    return done["response"]


SURFACES = {
    README_NPM: Surface(
        "/v1/chat/completions", "max_tokens",
        lambda x: "".join((c.get("delta") or {}).get("content") or ""
                          for e in x.events() for c in e.get("choices") or []),
        lambda r: [(m["role"], text_of(m.get("content"))) for m in r["messages"]
                   if m["role"] != "system"],
        lambda x: [e for e in x.events() if e.get("usage")][-1]["usage"][
            "prompt_tokens_details"]["cached_tokens"]),
    "@ai-sdk/openai": Surface(
        "/v1/responses", "max_output_tokens",
        lambda x: "".join(e["delta"] for e in x.events()
                          if e.get("type") == "response.output_text.delta"),
        lambda r: [(i["role"], text_of(i.get("content"))) for i in r["input"]
                   if i.get("role") not in (None, "system", "developer")],
        lambda x: _ended(x)["usage"]["input_tokens_details"]["cached_tokens"]),
    "@ai-sdk/anthropic": Surface(
        "/v1/messages", "max_tokens",
        lambda x: "".join(e["delta"].get("text", "") for e in x.events()
                          if e.get("type") == "content_block_delta"),
        lambda r: [(m["role"], text_of(m.get("content"))) for m in r["messages"]],
        lambda x: [e for e in x.events() if e.get("type") == "message_delta"][-1]["usage"][
            "cache_read_input_tokens"]),
}


def reply(x: Exchange) -> str:
    """The text mlxd streamed back, on whichever API `x` went."""
    return next(s for s in SURFACES.values() if s.path == x.path).reply(x)


class Session:
    """One opencode session through a Recorder, in its own home and project directory."""

    def __init__(self, server, tmp_path: Path, npm: str = README_NPM):
        self.server, self.tmp, self.npm = server, tmp_path, npm
        self.recorder = Recorder(server.url, (SURFACES[npm].path,))
        self.work = tmp_path / "work"
        self.work.mkdir()

    async def turn(self, proxy: str, text: str, first: bool) -> tuple[int, list[dict]]:
        """`opencode run` of `text` (continuing the session after the first): its exit
        code and its JSON events."""
        config = self.tmp / "opencode.json"
        config.write_text(json.dumps(config_for(proxy, CONTEXT, self.npm)))
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
@pytest.mark.parametrize("npm", list(SURFACES))
async def test_opencode_turns_on_readmes_config_over_each_api(capped_demo, tmp_path, npm):
    """Two turns of one session on README's config, and on the same provider through
    opencode's packages for the Responses and Messages APIs."""
    session, surface = Session(capped_demo, tmp_path, npm), SURFACES[npm]
    async with session.recorder.serving() as proxy:
        rc, first = await session.turn(proxy, "Say hi.", first=True)
        assert rc == 0, first
        rc, second = await session.turn(proxy, "Name one color.", first=False)
        assert rc == 0, second
    sent = session.recorder.exchanges
    assert sent and all(x.status == 200 for x in sent)
    assert {x.request[surface.cap] for x in sent} == {OUTPUT}  # the config's limit.output
    assert {x.request.get("temperature") for x in sent} == {0}
    agent = [x for x in sent if x.request.get("tools")]  # (not its title request)
    assert len(agent) == 2
    # What opencode showed is what mlxd streamed, and its next turn sends it back.
    assert texts(first) == [reply(agent[0])] and texts(second) == [reply(agent[1])]
    history = surface.history(agent[1].request)
    assert [role for role, _ in history] == ["user", "assistant", "user"]
    assert history[1][1] == reply(agent[0])
    # The second turn resumed from the first's prefix; opencode read that from usage.
    cached = surface.cached(agent[1])
    (finish,) = [e for e in second if e["type"] == "step_finish"]
    assert cached > 2000 and finish["part"]["tokens"]["cache"]["read"] == cached
    if surface.path == "/v1/responses":  # (by its key: the session's KV snapshot)
        assert {x.request.get("prompt_cache_key") for x in agent} == {first[0]["sessionID"]}


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
    history = [text_of(m.get("content")) for m in went_on.request["messages"]]
    assert any(reply(summaries[-1]) in c for c in history)
    assert not any(long in c for c in history)
    assert texts(events)[-1] == reply(went_on)
