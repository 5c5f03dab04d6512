"""Codex CLI end to end on the real `demo` model (8,192-token window) until it compacts:
Codex (0.171) compacts remotely against a provider it takes for OpenAI's (the built-in
provider with `openai_base_url`): it sends its history ending in a `compaction_trigger`,
keeps the one compaction item of the output, replaces its history with its user
messages and that item, and goes on with the turn on mlxd.

Skipped unless a Codex binary is given (CODEX_BIN, or `codex` on PATH): it comes from npm
(`npm install @openai/codex` into a temporary directory), which a test run does not
download. An auto-compaction limit of 400 tokens (a first turn's prompt alone passes it)
makes the second turn compact before it samples. Minutes on a shared CPU: the 135M model
rarely ends a reply to Codex's prompt soon.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from supervisor.api.responses.seal import Sealer

pytestmark = pytest.mark.integration

CODEX = os.environ.get("CODEX_BIN") or shutil.which("codex")


def codex(home, work, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}
    return subprocess.run([CODEX, "exec", "--skip-git-repo-check", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.skipif(CODEX is None, reason="no Codex CLI: set CODEX_BIN (npm @openai/codex)")
def test_codex_compacts_through_mlxd_and_goes_on(real_server, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "instructions.md").write_text("Answer in one short sentence.\n")
    (home / "config.toml").write_text(
        f'model = "demo"\nopenai_base_url = "{real_server.url}/v1"\n'
        "model_context_window = 8192\nmodel_auto_compact_token_limit = 400\n"
        f'model_instructions_file = "{home / "instructions.md"}"\n'
        "check_for_update_on_startup = false\n[analytics]\nenabled = false\n")
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
    sealed = Sealer.of_state_dir(real_server.state_dir).open(history[-1]["encrypted_content"])
    assert "Task: " in sealed["summary"]  # the server's own item, carried by Codex
