"""Sampling fields POST /v1/responses shares with chat completions, end to end through the
official `openai` SDK on the real tiny model: presence_penalty and frequency_penalty
are taken (a value out of range is a 400 naming it) and echoed; with
`include: ["message.output_text.logprobs"]` each output token's logprob and its
`top_logprobs` alternatives are on the output_text part and on the stream's deltas."""

from __future__ import annotations

import openai

from tests.openresponses.schema import check_event, check_response

LOGPROBS = ["message.output_text.logprobs"]


def ask(client, model_id, max_output_tokens=16, **kw):
    return client.responses.create(model=model_id, input="Tell me something",
                                   max_output_tokens=max_output_tokens, temperature=0, **kw)


def test_penalties_are_taken_and_echoed(client, model_id):
    """That they reach the worker's Generate: tests/supervisor/test_responses_params.py;
    that the worker applies them: tests/worker/test_worker_generation_features.py."""
    plain = ask(client, model_id)
    # (The SDK's create() has no parameter for them, though its Response has the fields.)
    r = ask(client, model_id, extra_body={"presence_penalty": 1.5, "frequency_penalty": -0.5})
    check_response(r.model_dump(mode="json", exclude_unset=True))
    assert (r.presence_penalty, r.frequency_penalty) == (1.5, -0.5)
    assert (plain.presence_penalty, plain.frequency_penalty) == (0.0, 0.0)
    assert r.status == "incomplete" and r.output_text
    bad = client.with_options(max_retries=0).responses.with_raw_response
    try:
        bad.create(model=model_id, input="x", extra_body={"frequency_penalty": 3})
    except openai.BadRequestError as e:
        assert e.body["param"] == "frequency_penalty"
    else:
        raise AssertionError("a penalty of 3 was taken")


def test_logprobs_on_the_part_and_on_the_deltas(client, model_id):
    r = ask(client, model_id, include=LOGPROBS, top_logprobs=2)
    assert r.top_logprobs == 2
    tokens = r.output[0].content[0].logprobs
    assert len(tokens) == r.usage.output_tokens
    for t in tokens:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the best one was picked
    events = list(ask(client, model_id, include=LOGPROBS, top_logprobs=2, stream=True))
    for ev in events:
        check_event(ev.model_dump(mode="json", exclude_unset=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [t.token for t in streamed] == [t.token for t in tokens]
    assert events[-1].response.output[0].content[0].logprobs == tokens
    # Not included: none computed.
    assert ask(client, model_id, top_logprobs=2).output[0].content[0].logprobs == []
