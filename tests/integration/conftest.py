"""Real processes: the supervisor (`python -m supervisor`) and its worker subprocesses."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serverproc import ServerProcess


@pytest.fixture(scope="session")
def server(tiny_model) -> ServerProcess:
    """One server on the tiny model, shared by the tests that do not break it."""
    with ServerProcess([str(tiny_model)], "--max-body-bytes", "65536") as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="session")
def qwen_server(family_model) -> ServerProcess:
    """A server on a tiny model with the Qwen/Hermes template (tools, <tool_call>, <think>),
    shared by the tool, grammar and reasoning tests of both API surfaces."""
    with ServerProcess([str(family_model("qwen"))]) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="session")
def stopping_server(models_dir) -> ServerProcess:
    """A server on a tiny model with Qwen3-Coder's tool-call template, edited to end each
    reply after one token (tests/openresponses/model.py), with an 8,192-token window: the
    Open Responses cases and the coding agents driven end to end (Codex, Claude Code)."""
    from tests.families import FAMILIES
    from tests.openresponses.model import build_stopping_model
    from worker.demos.text import build_model

    source = build_model(models_dir / "tiny-qwen3_coder-8k", "tiny", context_length=8192,
                         template=FAMILIES["qwen3_coder"]).path
    yield from _serving(build_stopping_model(source, models_dir / "tiny-qwen3_coder-8k-stopping"))


@pytest.fixture(scope="session")
def stopping_vision_server(vision_model, models_dir) -> ServerProcess:
    """A server on the tiny Qwen2-VL demo edited as `stopping_server`'s model is, so its
    replies end after one token: the Open Responses image case."""
    from tests.openresponses.model import build_stopping_model

    yield from _serving(build_stopping_model(vision_model, models_dir / "tiny-vision-stopping"))


def _serving(model):
    """A healthy server on one model, its `model` attribute the id to ask for."""
    with ServerProcess([str(model)]) as srv:
        srv.wait_healthy()
        srv.model = str(model)
        yield srv


@pytest.fixture(scope="session")
def model_id(tiny_model) -> str:
    return str(tiny_model)  # a path's id is the path as given


@pytest.fixture
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded ([DONE] stays a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_envelope(response: httpx.Response, status: int, code: str | None = None,
                    param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    assert "Traceback" not in response.text
    assert response.headers.get("X-Request-ID")
    return body["error"]
