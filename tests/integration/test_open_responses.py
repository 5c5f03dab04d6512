"""The Open Responses compliance suite (tests/openresponses/: its 17 cases, ported) against
a real mlxd: HTTP, SSE, WebSocket and compaction, one pytest test per upstream case id.

The model is a tiny one with a real tool-call template (Qwen3-Coder's) that ends its own
replies after one token (tests/openresponses/model.py; the session's `stopping_server`,
shared with the coding agents' tests), since the cases send no `max_output_tokens` and
expect `completed`; the image case runs on the Qwen2-VL demo edited the same way
(`stopping_vision_server`, started only for it), and checks besides that the image's
tokens reach the model. Every case must pass except those listed in
NEEDS_A_TOOL_CHOICE (skipped): they pass only when the model decides by itself to call a
tool, which random weights do not. BEING_BUILT lists, as strict xfails, the cases that
fail while their part of issue 32 is built.
"""

from __future__ import annotations

import pytest

from tests.openresponses.cases import CASES
from tests.openresponses.compliance import HEART_PNG, Suite, message

pytestmark = pytest.mark.integration

NEEDS_A_TOOL_CHOICE = {
    "tool-calling": "tool_choice is auto: the case passes only if the model chooses to "
                    "call get_weather, which random weights do not",
}
# Cases that fail only because a part of issue 32 is still being built: strict, so each
# turns into a failure the moment its feature lands (then its line goes).
BEING_BUILT: dict[str, str] = {}
# The server each case runs on, where it is not `stopping_server`.
SERVERS = {"image-input": "stopping_vision_server"}


def _marks(case: str):
    if case in NEEDS_A_TOOL_CHOICE:
        return [pytest.mark.skip(reason=NEEDS_A_TOOL_CHOICE[case])]
    if case in BEING_BUILT:
        return [pytest.mark.xfail(strict=True, reason=BEING_BUILT[case])]
    return []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in CASES])
def test_case(request, case):
    server = request.getfixturevalue(SERVERS.get(case, "stopping_server"))
    errors = CASES[case](Suite(server.url + "/v1", server.model))
    assert not errors, f"{case}:\n  " + "\n  ".join(errors)


def test_image_input_reaches_the_model(stopping_vision_server):
    """The image case passes whether or not the server hands the image to the model: its
    request here, with and without the image part, must differ in prompt tokens by the
    image's (4 to 16 image tokens of the demo, between its vision start and end). Each
    reply is a piece of a word (model.py mutes the tokens with no text of their own)."""
    suite = Suite(stopping_vision_server.url + "/v1", stopping_vision_server.model)
    text = {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."}
    image = {"type": "input_image", "image_url": HEART_PNG}

    def input_tokens(parts) -> int:
        r = suite.post("/responses", {"model": suite.model, "input": [message("user", parts)]})
        assert r.status_code == 200, r.text
        [item] = r.json()["output"]
        assert item["content"][0]["text"].strip("\ufffd")
        return r.json()["usage"]["input_tokens"]

    assert input_tokens([text, image]) - input_tokens([text]) >= 4 + 2
