"""The security defaults of a real mlxd: what it refuses to start with, keys through the
official client, and the modes of every file it writes (state, store, token, logs)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx
import openai
import pytest

from tests.serverproc import REPO, ServerProcess

pytestmark = pytest.mark.integration


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_exposed_address_without_a_key_does_not_start(tmp_path):
    run = subprocess.run([sys.executable, "-m", "supervisor", "--host", "0.0.0.0", "--port",
                          "0", "--model", "demo-random", "--state-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "without an API key" in run.stderr and "--insecure-no-auth" in run.stderr
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    keys.chmod(0o644)
    run = subprocess.run([sys.executable, "-m", "supervisor", "--model", "demo-random",
                          "--api-key-file", str(keys), "--state-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "chmod 600" in run.stderr


def test_keys_files_and_logs_of_a_running_server(tmp_path, tiny_model):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)  # a state dir others may enter: tightened at start
    keys = tmp_path / "keys"
    keys.write_text("sk-local-one\nsk-local-two\n")
    keys.chmod(0o600)
    with ServerProcess([str(tiny_model)], "--api-key-file", str(keys), state_dir=state) as srv:
        srv.wait_healthy()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-local-two", max_retries=0)
        reply = good.responses.create(model=str(tiny_model), input="secret words here",
                                      max_output_tokens=2)
        assert reply.status in ("completed", "incomplete")
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        r = httpx.get(srv.url + "/v1/models", headers={"Host": "evil.example"}, timeout=5)
        assert r.status_code == 403
        assert mode(state) == 0o700
        logs = state / "logs"
        assert mode(logs) == 0o700 and mode(logs / "mlxd.log") == 0o600
        private = [state / "admin-token", state / "responses.db"]
        private += [p for p in state.glob("responses.db-*") if p.is_file()]  # -wal, -shm
        for path in private:
            assert mode(path) == 0o600, path
        log_text = (logs / "mlxd.log").read_text()
        assert "sk-local" not in log_text  # keys never reach a log
        assert "sk-local" not in srv.log(tail=None)
        assert "secret words" not in log_text + srv.log(tail=None)  # nor prompts
