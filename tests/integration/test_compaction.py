"""Responses compaction on the real `demo` model (SmolLM2-135M) through the official
`openai` SDK: `client.responses.compact` returns OpenAI's shape and a summary that keeps
what an agent needs (read back here with the server's key, which only a test may do);
its output continues a conversation; `context_management` on `responses.create` compacts
past its threshold (streamed: the compaction item before the answer's) and the next turn
resumes from the compacted response's KV snapshot;
another mlxd instance refuses the item.

Lean: one compaction and one compacted chain for the module (this CPU runs the model at
a few tokens a second), and the two summaries (demo may write up to 160 tokens each; these
conversations' take about 70 and 30) are asked for at once, so the worker decodes them in
one batch instead of one after the other.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from supervisor.api.responses.seal import Sealer
from tests.integration.conftest import assert_envelope
from tests.integration.test_snapshots import assert_resumed

pytestmark = pytest.mark.integration

TASK = ("The function parse_date in utils/dates.py crashes on empty strings. "
        "Fix it and add a test in tests/test_dates.py.")
SOURCE = "def parse_date(s):\n    y, m, d = s.split('-')\n    return date(int(y), int(m), int(d))\n"
AGENT = [
    {"role": "user", "content": TASK},
    {"type": "function_call", "call_id": "c1", "name": "read_file",
     "arguments": '{"path": "utils/dates.py"}'},
    {"type": "function_call_output", "call_id": "c1", "output": SOURCE},
    {"type": "message", "role": "assistant", "content": "The crash comes from s.split on an "
     "empty string. I decided to return None for empty input instead of raising."},
    {"role": "user", "content": "OK. Keep the function signature unchanged."},
    {"type": "message", "role": "assistant", "content": "I changed utils/dates.py: parse_date "
     "now returns None when s is empty. Next I will write tests/test_dates.py."},
]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)


def managed_turn(client) -> list:
    """The streamed events of a turn whose `context_management` compacts its input."""
    long_file = "\n".join(f"def helper_{i}(value):\n    return value + {i}\n"
                          for i in range(120))  # about 2,000 tokens of a file read
    return list(client.responses.create(
        model="demo", temperature=0, max_output_tokens=4, stream=True,
        context_management=[{"type": "compaction", "compact_threshold": 1000}],
        input=[{"role": "user", "content": TASK},
               {"type": "function_call", "call_id": "c1", "name": "read_file",
                "arguments": '{"path": "utils/helpers.py"}'},
               {"type": "function_call_output", "call_id": "c1", "output": long_file},
               # (With the assistant's reading of the file, demo's notes end in about 30
               # tokens; without it they repeat one sentence to the summary's 160.)
               {"type": "message", "role": "assistant", "content": "I read utils/helpers.py:"
                " it defines helper_0 to helper_119, each adding its number to value."},
               {"role": "user", "content": "Which helper adds 7?"}]))


@pytest.fixture(scope="module")
def both(client):
    """`responses.compact`'s answer and the compacting turn's events, asked for at once."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        managed = pool.submit(managed_turn, client)
        return client.responses.compact(model="demo", input=AGENT), managed.result()


@pytest.fixture(scope="module")
def compacted(both):
    return both[0]


def test_compact_keeps_what_an_agent_needs(compacted, real_server):
    assert compacted.object == "response.compaction"
    kinds = [(o.type, getattr(o, "role", None)) for o in compacted.output]
    assert kinds == [("message", "user"), ("message", "user"), ("compaction", None)]
    content = compacted.output[-1].encrypted_content
    assert "parse_date" not in content  # opaque to the client
    summary = Sealer.of_state_dir(real_server.state_dir).open(content)["summary"]
    assert f"Task: {TASK}" in summary
    assert "Latest request: OK. Keep the function signature unchanged." in summary
    assert "Files: utils/dates.py, tests/test_dates.py" in summary
    notes = summary.split("Notes: ", 1)[1]
    assert len(notes.split()) >= 5 and "parse_date" in notes  # the model's own reading
    assert 0 < compacted.usage.output_tokens <= 160


def test_the_compacted_output_continues_the_conversation(client, compacted):
    follow = [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]
    r = client.responses.create(model="demo", store=False, max_output_tokens=4, input=follow + [
        {"role": "user", "content": "Write the test now."}])
    assert r.status in ("completed", "incomplete") and r.output_text


def test_context_management_compacts_and_the_next_turn_resumes_from_it(client, both):
    events = both[1]
    # Streamed: the response opens before the summary is written, the compaction item
    # comes whole before the answer's items.
    kinds = [(e.type, getattr(getattr(e, "item", None), "type", None)) for e in events]
    assert kinds[:5] == [("response.created", None), ("response.in_progress", None),
                         ("response.output_item.added", "compaction"),
                         ("response.output_item.done", "compaction"),
                         ("response.output_item.added", "message")]
    first = events[-1].response
    assert [o.type for o in first.output][0] == "compaction"
    assert first.usage.input_tokens < 1000  # the summary and the turn, not the file
    nxt = client.responses.create(model="demo", temperature=0, max_output_tokens=4,
                                  previous_response_id=first.id, input="And 8?",
                                  context_management=[{"type": "compaction",
                                                       "compact_threshold": 1000}])
    assert [o.type for o in nxt.output] == ["message"]  # under the threshold now
    assert_resumed(first, nxt)  # from the compacted response's own snapshot


def test_another_instance_refuses_the_item(server, model_id, compacted):
    item = compacted.output[-1].model_dump(exclude_none=True, warnings=False)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in ("/v1/responses", "/v1/responses/compact"):
            r = http.post(path, json={"model": model_id, "input": [
                item, {"role": "user", "content": "go on"}]})
            error = assert_envelope(r, 400, "invalid_encrypted_content", "input")
            assert item["id"] in error["message"]
