"""`truncation: "auto"` on POST /v1/responses (supervisor/api/responses/truncation.py), end
to end through the official `openai` SDK on the tiny model served with a 512-token window:
a conversation past it is refused as it is by default and, with "auto", answered from its
last turns, the fewest dropped: the prompt it answered from is, token for token, the one
/v1/responses/input_tokens counts for the conversation from the first user message that
fits. Streamed too, a stored response's next turn (previous_response_id) cut alike,
without max_output_tokens room left for the server's --default-max-tokens, and under a
context-management threshold set past the window."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.openresponses.schema import check_event, check_response
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

WINDOW = 512
OUT = 8


DEFAULT = 64  # the server's --default-max-tokens


@pytest.fixture(scope="module")
def capped(tiny_model):
    with ServerProcess([str(tiny_model)], "--max-context-tokens", str(WINDOW),
                       "--default-max-tokens", str(DEFAULT)) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture
def client(capped):
    return openai.OpenAI(base_url=capped.url + "/v1", api_key="unused", max_retries=0)


def conversation(turns: int = 8, asked: int = 25, answered: int = 15) -> list[dict]:
    items = [{"type": "message", "role": "developer", "content": "Answer briefly."}]
    for t in range(turns):
        items.append({"type": "message", "role": "user", "content": f"Question {t}: "
                      + " ".join(f"word{t}x{i}" for i in range(asked))})
        items.append({"type": "message", "role": "assistant", "content": f"Answer {t}: "
                      + " ".join(f"reply{t}y{i}" for i in range(answered))})
    items.append({"type": "message", "role": "user", "content": "And the last question?"})
    return items


def counted(capped, model_id, items) -> int:
    r = httpx.post(f"{capped.url}/v1/responses/input_tokens",
                   json={"model": model_id, "input": items}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def first_fit(capped, model_id, items, out: int = OUT) -> int:
    """Input tokens of the conversation from its first user message that leaves `out`
    tokens of the window (the developer message kept), counted by the server's own
    endpoint."""
    starts = [i for i, it in enumerate(items) if i > 1 and it["role"] == "user"]
    for s in starts:
        n = counted(capped, model_id, items[:1] + items[s:])
        if n + out <= WINDOW:
            return n
    raise AssertionError("nothing fits")


def test_a_conversation_past_the_window_is_cut_from_its_start_with_auto(
        client, capped, model_id):
    items = conversation()
    assert counted(capped, model_id, items) > WINDOW  # (the test's premise)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input=items, max_output_tokens=OUT)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(model=model_id, input=items, max_output_tokens=OUT,
                                temperature=0, truncation="auto")
    check_response(r.model_dump(mode="json", exclude_unset=True))
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == first_fit(capped, model_id, items)
    assert r.usage.input_tokens + OUT <= WINDOW
    plain = client.responses.create(model=model_id, input="Hi", max_output_tokens=OUT)
    assert plain.truncation == "disabled"


def test_streamed_and_continued_by_previous_response_id(client, capped, model_id):
    items = conversation(6)
    events = list(client.responses.create(model=model_id, input=items, max_output_tokens=OUT,
                                          temperature=0, truncation="auto", stream=True))
    for ev in events:
        check_event(ev.model_dump(mode="json", exclude_unset=True))
    done = events[-1].response
    assert done.truncation == "auto"
    assert done.usage.input_tokens == first_fit(capped, model_id, items)
    # The next turn continues the stored response: its chain is past the window again.
    more = conversation(2)[1:]
    r = client.responses.create(model=model_id, previous_response_id=done.id, input=more,
                                max_output_tokens=OUT, temperature=0, truncation="auto")
    assert r.usage.input_tokens + OUT <= WINDOW and r.previous_response_id == done.id
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, previous_response_id=done.id, input=more,
                                max_output_tokens=OUT)
    assert e.value.body["code"] == "context_length_exceeded"


def test_without_max_output_tokens_the_servers_default_is_left_room(client, capped, model_id):
    items = conversation(40, 4, 2)  # (short turns: the cut can land between the two rooms)
    # (the premise: room for one token would keep a turn more than room for the default)
    assert first_fit(capped, model_id, items, 1) > first_fit(capped, model_id, items, DEFAULT)
    r = client.responses.create(model=model_id, input=items, temperature=0,
                                truncation="auto")
    assert r.usage.input_tokens == first_fit(capped, model_id, items, DEFAULT)
    assert r.usage.output_tokens <= DEFAULT


def test_under_a_compact_threshold_past_the_window_auto_still_cuts(client, capped, model_id):
    # Context management with its threshold set above the window: the conversation is
    # under it (not compacted) but past the window, so "auto" cuts it as without.
    items = conversation()
    managed = [{"type": "compaction", "compact_threshold": 100 * WINDOW}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input=items, max_output_tokens=OUT,
                                context_management=managed)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(model=model_id, input=items, max_output_tokens=OUT,
                                temperature=0, truncation="auto", context_management=managed)
    assert not [o for o in r.output if o.type == "compaction"]
    assert r.usage.input_tokens == first_fit(capped, model_id, items)


def test_an_unknown_truncation_is_a_400_naming_it(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="Hi", extra_body={"truncation": "some"})
    assert e.value.body["param"] == "truncation"
