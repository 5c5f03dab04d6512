"""Codex CLI end to end on a small-context model until it compacts, and with an MCP
server's tools: Codex (0.171)
compacts remotely against a provider it takes for OpenAI's (the built-in provider with
`openai_base_url`): it sends its history ending in a `compaction_trigger`, keeps the one
compaction item of the output, replaces its history with its user messages and that
item, and goes on with the turn on mlxd.

Codex is the pinned one that `make clients` installs from npm (tests/clients/), or
CODEX_BIN; without it the test skips, or fails under MLXD_REQUIRE_UI_TOOLS=1 (as in CI).
The model is the tiny one that ends each reply after one token (`stopping_server`, 8,192
tokens, shared with the Open Responses cases): the real `demo` model, given Codex's
prompt, seldom ends a reply within minutes on a shared CPU. An auto-compaction limit of
400 tokens (a first turn's prompt alone passes it) makes the second turn compact before it
samples; the summary is the server's compaction, written by that model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from supervisor.api.responses.seal import Sealer
from tests.clients import cli
from tests.clients.recorder import Recorder
from tests.serverproc import REPO

pytestmark = pytest.mark.integration


def codex(home, work, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}
    return subprocess.run([cli("codex", "CODEX_BIN"), "exec", "--skip-git-repo-check", *args],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_codex_compacts_through_mlxd_and_goes_on(stopping_server, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "instructions.md").write_text("Answer in one short sentence.\n")
    (home / "config.toml").write_text(
        f'model = "{stopping_server.model}"\nopenai_base_url = "{stopping_server.url}/v1"\n'
        "model_context_window = 8192\nmodel_auto_compact_token_limit = 400\n"
        f'model_instructions_file = "{home / "instructions.md"}"\n'
        "check_for_update_on_startup = false\n[analytics]\nenabled = false\n"
        # Its sub-agent tools (a `namespace` tool, which mlxd offers the model) would not
        # fit the 8K window of this tiny tokenizer beside its prompt.
        "[features]\nmulti_agent = false\n")
    first = codex(home, work, "Say hello.")  # its prompt alone passes 400 tokens
    assert first.returncode == 0, first.stderr[-2000:]
    second = codex(home, work, "resume", "--last", "Name one color.")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-2000:]
    assert "context compacted" in out and "Error running remote compact task" not in out
    assert "\ncodex\n" in out.split("context compacted", 1)[1]  # the turn went on
    (rollout,) = (home / "sessions").rglob("*.jsonl")
    compacted = [json.loads(line)["payload"] for line in rollout.read_text().splitlines()
                 if '"compacted"' in line]
    history = compacted[-1]["replacement_history"]
    assert [i["type"] for i in history][-1] == "compaction"
    assert {i.get("role") for i in history[:-1]} <= {"user", "developer"}
    sealer = Sealer.of_state_dir(stopping_server.state_dir)
    sealed = sealer.open(history[-1]["encrypted_content"])
    assert "Task: " in sealed["summary"]  # the server's own item, carried by Codex


@pytest.mark.timeout(300)
async def test_codex_offers_an_mcp_servers_tools_to_the_model_through_mlxd(stopping_server,
                                                                           tmp_path):
    """Codex sends an MCP server's tools as a `namespace` tool; they reach the model's
    prompt: the request as Codex sent it counts more tokens than the same request without
    them (POST /v1/responses/input_tokens renders the tools as generation would)."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    recorder = Recorder(stopping_server.url, ("/v1/responses",))
    async with recorder.serving() as proxy:
        (home / "config.toml").write_text(
            f'model = "{stopping_server.model}"\nopenai_base_url = "{proxy}/v1"\n'
            "model_context_window = 8192\ncheck_for_update_on_startup = false\n"
            "[analytics]\nenabled = false\n[features]\nmulti_agent = false\n"
            f'[mcp_servers.weather]\ncommand = "{sys.executable}"\n'
            f'args = ["{REPO / "tests" / "clients" / "mcp_weather.py"}"]\n')
        # (The proxy has no WebSocket: Codex falls back to HTTP after a few tries.)
        done = await asyncio.to_thread(codex, home, work, "Say hello.")
    assert done.returncode == 0, done.stderr[-2000:]
    [asked] = [x.request for x in recorder.exchanges if x.status == 200]
    [space] = [t for t in asked["tools"] if t["type"] == "namespace"]
    assert space["name"] == "mcp__weather"
    assert [t["name"] for t in space["tools"]] == ["get_weather"]
    count = {k: v for k, v in asked.items() if k not in ("stream", "include", "store")}
    without = {**count, "tools": [t for t in asked["tools"] if t is not space]}
    async with httpx.AsyncClient(base_url=stopping_server.url, timeout=60) as http:
        counts = [(await http.post("/v1/responses/input_tokens", json=body)).json()
                  ["input_tokens"] for body in (count, without)]
    assert counts[0] > counts[1] > 0
