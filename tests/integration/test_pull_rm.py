"""`mlxctl pull` into a running server's cache from a local Hugging Face-speaking server,
then `mlxctl rm`: refused while the model is loaded, done once it is unloaded (and the
listings forget it), and done by mlxctl itself when no server runs."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.hubserver import Hub, HubServer, Repo
from tests.integration.test_mlxctl import mlxctl
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def env_for(url: str, cache) -> dict:
    return {"HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}


def listed(srv) -> set[str]:
    return {m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]}


def mlxctl_models(srv) -> dict[str, str]:
    out = mlxctl(srv, "models", "--json")
    assert out.returncode == 0, out.stderr
    return {m["id"]: m["state"] for m in json.loads(out.stdout)["models"]}


def test_pull_load_then_rm_refused_while_loaded(tiny_model, monkeypatch):
    files = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file()}
    with ServerProcess([str(tiny_model)]) as srv, HubServer(Hub({"org/tiny": Repo(files)})) as hub:
        srv.wait_healthy()
        cache = srv.state_dir / "hf-cache"
        for k, v in env_for(hub, cache).items():
            monkeypatch.setenv(k, v)
        out = mlxctl(srv, "pull", "org/tiny")
        assert out.returncode == 0, out.stderr
        folder = cache / "models--org--tiny"
        assert folder.is_dir() and "org/tiny" in listed(srv)

        out = mlxctl(srv, "load", "org/tiny")
        assert out.returncode == 0, out.stderr
        assert mlxctl_models(srv)["org/tiny"] == "ready"
        out = mlxctl(srv, "rm", "org/tiny")
        assert out.returncode == 1 and "is loaded" in out.stderr and "unload it first" in out.stderr
        assert "Traceback" not in out.stderr and folder.is_dir()

        assert mlxctl(srv, "unload", "org/tiny").returncode == 0
        out = mlxctl(srv, "rm", "org/tiny", "--json")
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["freed_bytes"] >= sum(map(len, files.values())) and not folder.exists()
        assert "org/tiny" not in listed(srv) and "org/tiny" not in mlxctl_models(srv)
        out = mlxctl(srv, "rm", "org/tiny")
        assert out.returncode == 1 and "not in the Hugging Face cache" in out.stderr
        out = mlxctl(srv, "rm", str(tiny_model))     # a local directory is never deleted
        assert out.returncode == 2 and "repo id" in out.stderr and tiny_model.is_dir()


def test_rm_without_a_server_deletes_it_here(tiny_model, tmp_path, monkeypatch):
    files = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file()}
    cache = tmp_path / "hub"
    with HubServer(Hub({"org/tiny": Repo(files)})) as hub:
        for k, v in env_for(hub, cache).items():
            monkeypatch.setenv(k, v)
        down = "http://127.0.0.1:9"
        assert mlxctl(down, "pull", "org/tiny", state_dir=tmp_path).returncode == 0
    out = mlxctl(down, "rm", "org/tiny", state_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "removed org/tiny" in out.stdout and not (cache / "models--org--tiny").exists()
