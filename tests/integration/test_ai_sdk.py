"""The Vercel AI SDK (`ai` 6 with @ai-sdk/openai, @ai-sdk/anthropic and
@ai-sdk/openai-compatible, from npm: tests/clients/) against a real mlxd, through each API
it speaks: the Responses API and chat completions (OpenAI's package), the Messages API
(Anthropic's) and chat completions again (the openai-compatible package, what opencode's
README config uses). The SDK validates every response and stream part it reads with its
own zod schemas, so a shape it does not accept fails its check here.

Per API: text, streamed and not; a tool the SDK runs in a two-step loop (`toolChoice:
required`, the grammar-built call); `generateObject`/`streamObject` (a JSON schema on
OpenAI's APIs; Anthropic's package forces a `json` tool); an image. Then reasoning as each
package reads it (a Responses `reasoning.summary`, Anthropic's thinking blocks, chat's
`reasoning_content`) and embeddings. tests/clients/ai_sdk.mjs runs them all in one Node
process, one JSON line each; the models are tiny random ones (the tool-calling one ends
its replies after one token, tests/openresponses/model.py), so what is checked is shape,
usage and what the SDK parsed, not words."""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.clients import BIN
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parents[1] / "clients" / "ai_sdk.mjs"
APIS = ("responses", "chat", "messages", "compatible")


def _node() -> str:
    """node, with the SDK's packages installed; skips without them (fails under
    MLXD_REQUIRE_UI_TOOLS=1, as tests/clients' CLIs do)."""
    node = shutil.which("node")
    if node and (BIN.parent / "ai" / "package.json").exists():
        return node
    why = "no node or no AI SDK packages: `make clients` installs them (tests/clients/package.json)"
    if os.environ.get("MLXD_REQUIRE_UI_TOOLS") == "1":
        pytest.fail(why + " and MLXD_REQUIRE_UI_TOOLS=1")
    pytest.skip(why)


@pytest.fixture(scope="module")
def sdk(models_dir, family_model, vision_model, embed_model):
    """(the server, its models by role, {check name: what the SDK saw}): one server with a
    tool-calling model, a reasoning one, a vision one and an embedding one."""
    from tests.families import FAMILIES
    from tests.openresponses.model import build_stopping_model
    from tests.worker.test_worker_vision import png
    from worker.demos.text import build_model

    node = _node()
    source = build_model(models_dir / "tiny-qwen3_coder-8k", "tiny", context_length=8192,
                         template=FAMILIES["qwen3_coder"]).path
    models = {"tools": str(build_stopping_model(source,
                                                 models_dir / "tiny-qwen3_coder-8k-stopping")),
              "think": str(family_model("qwen")), "vision": str(vision_model),
              "embed": str(embed_model("bert"))}
    with ServerProcess(list(models.values())) as srv:
        srv.wait_healthy(timeout=300)
        config = {"url": srv.url, **models, "image": base64.b64encode(png()).decode()}
        run = subprocess.run([node, str(SCRIPT), json.dumps(config)], capture_output=True,
                             text=True, timeout=600, cwd=SCRIPT.parent)
        assert run.returncode == 0, run.stderr[-2000:]
        seen = {}
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                got = json.loads(line)
                seen[got.pop("name")] = got
        yield srv, models, seen


def passed(sdk, name: str) -> dict:
    got = sdk[2].get(name)
    assert got is not None, f"{name}: not run"
    assert got["ok"], f"{name}: {got.get('error')} {got.get('body')}"
    return got


@pytest.mark.parametrize("api", APIS)
def test_text_streamed_and_not_with_its_usage(sdk, api):
    for name in (f"{api} text", f"{api} stream"):
        got = passed(sdk, name)
        assert got["finish"] in ("stop", "length"), name
        usage = got["usage"]
        assert usage["inputTokens"] > 0 and usage["outputTokens"] >= 1, (name, usage)
        assert usage["totalTokens"] == usage["inputTokens"] + usage["outputTokens"], name
    parts = passed(sdk, f"{api} stream")["parts"]
    assert {"start", "finish-step", "finish"} <= set(parts), parts


@pytest.mark.parametrize("api", APIS)
def test_a_tool_runs_in_the_sdks_loop(sdk, api):
    got = passed(sdk, f"{api} tools")
    assert got["steps"] == 2 and len(got["calls"]) == 1
    (call,) = got["calls"]
    assert call["city"] in ("Paris", "Rome") and 1 <= call["days"] <= 7
    assert got["results"] == [{**call, "temp": 21}]  # the SDK ran it on what it parsed
    streamed = passed(sdk, f"{api} stream tools")
    assert streamed["steps"] == 2 and len(streamed["calls"]) == 1
    assert {"tool-call", "tool-result", "tool-input-start"} <= set(streamed["parts"])


@pytest.mark.parametrize("api", APIS)
def test_objects_come_back_in_their_schema(sdk, api):
    for name in (f"{api} object", f"{api} stream object"):
        obj = passed(sdk, name)["object"]
        assert set(obj) == {"city", "ok"} and obj["city"] in ("Paris", "Rome"), name
        assert isinstance(obj["ok"], bool), name
    assert passed(sdk, f"{api} stream object")["partials"] >= 1


@pytest.mark.parametrize("api", APIS)
def test_an_image_part_reaches_the_vision_model(sdk, api):
    got = passed(sdk, f"{api} image")
    assert got["finish"] in ("stop", "length") and got["usage"]["outputTokens"] >= 1
    # The image's tokens besides the words (the same words alone: fewer).
    assert got["usage"]["inputTokens"] > got["without"]["inputTokens"] + 4


def test_reasoning_reaches_each_package_as_it_reads_it(sdk):
    srv, models, _ = sdk
    got = passed(sdk, "responses reasoning")
    assert got["reasoning"]  # (a summary: the only reasoning this SDK reads there)
    stored = httpx.get(f"{srv.url}/v1/responses/{got['id']}", timeout=30).json()
    (item,) = [o for o in stored["output"] if o["type"] == "reasoning"]
    assert got["reasoning"] == item["content"][0]["text"] == item["summary"][0]["text"]
    streamed = passed(sdk, "responses stream reasoning")
    assert streamed["reasoning"] and "reasoning-delta" in streamed["parts"]
    assert passed(sdk, "messages reasoning")["reasoning"]
    # Stateless: the reasoning went back sealed in the conversation's next request.
    stateless = passed(sdk, "responses stateless reasoning")
    assert stateless["reasoning"] and "reasoning.encrypted_content" in stateless["include"]
    assert len(stateless["sentBack"]) == 1 and stateless["sentBack"][0].startswith("mlxd1.")
    assert passed(sdk, "compatible reasoning")["reasoning"]


def test_embeddings_through_both_packages(sdk):
    got = passed(sdk, "embeddings")
    vectors = got["embeddings"]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) == len(got["compatible"])
    assert all(abs(math.hypot(*v) - 1) < 1e-3 for v in vectors)  # (normalised, as served)
    assert vectors[0] == pytest.approx(got["compatible"], abs=1e-5)  # the same input
    assert got["usage"]["tokens"] > 0 and got["dimensions"] == 16
