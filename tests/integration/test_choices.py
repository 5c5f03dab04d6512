"""A request's choices with real processes and the official SDK: `n` on chat and legacy
completions, and a legacy completion's batch of prompts (supervisor/api/choices.py). Each
choice is what the same request alone gives; they run side by side in the worker's batch;
usage counts a prompt once; a client that leaves cancels every choice."""

from __future__ import annotations

import httpx

from tests.integration.conftest import sse_events
from tests.integration.test_faults import long_stream_body, wait_for, worker

CHAT = [{"role": "user", "content": "Tell me about the sea"}]


def chat(client, model_id, **kw):
    return client.chat.completions.create(model=model_id, messages=CHAT, **kw)


def test_n_chat_choices_each_equal_the_request_alone(client, model_id):
    alone = chat(client, model_id, temperature=0, max_tokens=12)
    many = chat(client, model_id, temperature=0, max_tokens=12, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice in many.choices:
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
    # The prompt counts once, as OpenAI counts it for `n`; the completions add up.
    assert many.usage.prompt_tokens == alone.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * alone.usage.completion_tokens
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


def test_n_sampled_choices_are_seeded_one_after_another(client, model_id):
    """With a seed, choice j samples as the request alone with seed + j: the choices
    differ, and the same request gives them again."""
    kw = dict(temperature=1.0, max_tokens=12, seed=7)
    many = [c.message.content for c in chat(client, model_id, n=3, **kw).choices]
    assert [c.message.content for c in chat(client, model_id, n=3, **kw).choices] == many
    assert len(set(many)) == 3, many
    for j, text in enumerate(many):
        assert chat(client, model_id, **{**kw, "seed": 7 + j}).choices[0].message.content \
            == text, j


def test_n_streamed_chat_choices(client, model_id):
    whole = chat(client, model_id, temperature=0, max_tokens=10, n=2)
    stream = chat(client, model_id, temperature=0, max_tokens=10, n=2, stream=True,
                  stream_options={"include_usage": True})
    texts, roles, finishes, usage = {0: "", 1: ""}, {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        i = choice.index
        assert i not in finishes, "a chunk after its choice's finish_reason"
        if choice.delta.role:
            assert texts[i] == "" and i not in roles  # each choice opens once, first
            roles[i] = choice.delta.role
        texts[i] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[i] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_completion_batch_of_prompts_with_n(client, model_id):
    """Prompts given as a list (strings and token ids mixed), `n` each: choice p * n + j
    is prompt p's, as alone; streamed the same."""
    prompts = ["Once upon a time", [300, 301, 302, 303], "The sea"]
    alone = [client.completions.create(model=model_id, prompt=p, max_tokens=6,
                                       temperature=0) for p in prompts]
    batch = client.completions.create(model=model_id, prompt=prompts, max_tokens=6,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = [""] * 6
    finished = set()
    for chunk in client.completions.create(model=model_id, prompt=prompts, max_tokens=6,
                                           temperature=0, n=2, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert texts == [c.text for c in batch.choices] and finished == set(range(6))


def test_a_client_leaving_cancels_every_choice(server, model_id):
    """The choices run side by side (all four in the worker's batch at once); closing the
    stream cancels them all."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={**long_stream_body(model_id, 2000), "n": 4}) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            wait_for(lambda: worker(server)["worker_active"] == 4, 30)
            s.close()
        wait_for(lambda: worker(server)["in_flight"] == 0
                 and worker(server)["worker_active"] == 0, 30)
        r = http.post("/v1/chat/completions", json={
            "model": model_id, "messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_too_many_choices_is_a_400(http, model_id):
    r = http.post("/v1/completions", json={"model": model_id, "prompt": ["a"] * 65, "n": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/chat/completions", json={"model": model_id, "messages": CHAT, "n": 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    events = sse_events(http.post("/v1/chat/completions", json={
        "model": model_id, "messages": CHAT, "n": 2, "max_tokens": 2, "stream": True}))
    assert events[-1] == "[DONE]"
    assert sorted({e["choices"][0]["index"] for e in events[:-1]}) == [0, 1]


def test_n_choices_of_a_long_prompt_prefill_it_once(client, http, model_id):
    # The first choice keeps the prompt's state as its prefill ends; the other three wait
    # for it and start from it in the worker's prefix cache (worker/loop/batch.py `same`),
    # each with the text the request alone gives. (Token ids: no template header that an
    # earlier request's state would serve.)
    import time

    def reused() -> tuple[float, float]:
        """(hits, tokens reused) of the worker's prefix cache, once they stand still:
        they come with its heartbeat, once a second."""
        def read():
            key = f'{{model="{model_id}"}}'
            lines = dict(line.rsplit(" ", 1) for line in http.get("/metrics").text.splitlines()
                         if line.startswith("mlxd_prompt_cache_"))
            return tuple(float(lines.get(f"mlxd_prompt_cache_{name}_total{key}", 0))
                         for name in ("hits", "tokens_reused"))
        last = read()
        while True:
            time.sleep(1.5)
            now = read()
            if now == last:
                return now
            last = now

    ids = [(7 * i) % 200 + 10 for i in range(300)]
    kw = dict(model=model_id, prompt=ids, temperature=0, max_tokens=6)
    alone = client.completions.create(**kw, extra_body={"prompt_cache_key": "n-alone"})
    hits, tokens = reused()
    many = client.completions.create(**kw, n=4, extra_body={"prompt_cache_key": "n-4"})
    after_hits, after_tokens = reused()
    assert (after_hits - hits, after_tokens - tokens) == (3, 3 * (len(ids) - 1))
    assert [c.text for c in many.choices] == [alone.choices[0].text] * 4
    assert many.usage.prompt_tokens == alone.usage.prompt_tokens == len(ids)
