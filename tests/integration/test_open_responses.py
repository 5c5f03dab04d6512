"""The Open Responses compliance suite (tests/openresponses/: its 17 cases, ported) against
a real mlxd: HTTP, SSE, WebSocket and compaction, one pytest test per upstream case id.

The model is a tiny one with a real tool-call template (Qwen3-Coder's) that ends its own
replies after one token (tests/openresponses/model.py; the session's `stopping_server`,
shared with the coding agents' tests), since the cases send no `max_output_tokens` and
expect `completed`. Every case must pass except those listed in
NEEDS_A_TOOL_CHOICE (skipped): they pass only when the model decides by itself to call a
tool, which random weights do not. BEING_BUILT lists, as strict xfails, the cases that
fail while their part of issue 32 is built.
"""

from __future__ import annotations

import pytest

from tests.openresponses.cases import CASES
from tests.openresponses.compliance import Suite

pytestmark = pytest.mark.integration

NEEDS_A_TOOL_CHOICE = {
    "tool-calling": "tool_choice is auto: the case passes only if the model chooses to "
                    "call get_weather, which random weights do not",
}
# Cases that fail only because a part of issue 32 is still being built: strict, so each
# turns into a failure the moment its feature lands (then its line goes).
BEING_BUILT = {
    # Not a feature being built: mlxd refuses an image for a text model by design (400).
    # It needs a vision test model that ends its own replies (model.py's edit on the
    # Qwen2-VL demo of worker/demos/vision.py), not done yet.
    "image-input": "issue 32: no vision test model that ends its replies yet",
}


@pytest.fixture(scope="module")
def suite(stopping_server) -> Suite:
    return Suite(stopping_server.url + "/v1", stopping_server.model)


def _marks(case: str):
    if case in NEEDS_A_TOOL_CHOICE:
        return [pytest.mark.skip(reason=NEEDS_A_TOOL_CHOICE[case])]
    if case in BEING_BUILT:
        return [pytest.mark.xfail(strict=True, reason=BEING_BUILT[case])]
    return []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in CASES])
def test_case(suite, case):
    errors = CASES[case](suite)
    assert not errors, f"{case}:\n  " + "\n  ".join(errors)
