"""Codex CLI end to end on a small-context model until it compacts: Codex (0.171)
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

import json
import os
import subprocess

import pytest

from supervisor.api.responses.seal import Sealer
from tests.clients import cli

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
