"""Continuous batching and the prompt-prefix cache through the real server, with the
official client: concurrent streams each get what they get alone, a cancel leaves the
others intact, and reuse shows in usage, /metrics and the status."""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import httpx
import openai
import pytest

from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

QUESTIONS = ["Tell me a story", "Hi", "What is the capital of France, and why is it there?",
             "word " * 30]
SYSTEM = "You are a careful assistant. " + "Follow every rule below. " * 60  # ~300 tokens


def chat(client, model, content, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(
        model=model, temperature=0, messages=[{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": content}], **kw)


def streamed(client, model, content, max_tokens=24):
    chunks = client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens, stream=True,
        messages=[{"role": "user", "content": content}])
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_concurrent_streams_equal_their_solo_output_and_a_cancel_spares_the_others(
        server, client, model_id):
    solo = {q: streamed(client, model_id, q) for q in QUESTIONS}
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS) + 1) as pool:
        # A long stream abandoned after a few chunks: the server cancels it.
        def abandoned():
            stream = client.chat.completions.create(
                model=model_id, temperature=0, max_tokens=3000, stream=True,
                messages=[{"role": "user", "content": "Hello"}])
            for i, _ in enumerate(stream):
                if i == 5:
                    stream.close()
                    return i

        gone = pool.submit(abandoned)
        together = {q: pool.submit(streamed, client, model_id, q) for q in QUESTIONS}
        assert gone.result(timeout=60) == 5
        for q in QUESTIONS:
            assert together[q].result(timeout=60) == solo[q], q
    status = httpx.get(server.url + "/health", timeout=10).json()
    assert status["workers"][0]["restarts"] == 0


def test_a_repeated_prompt_reports_its_cached_tokens_and_answers_the_same(server, client,
                                                                          model_id):
    cold = chat(client, model_id, "What is a cache?")
    warm = chat(client, model_id, "What is a cache?")
    assert cold.usage.prompt_tokens == warm.usage.prompt_tokens
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= cold.usage.prompt_tokens - 2  # all but the token that starts decoding
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # The next turn of the conversation reuses the system prompt and the first turn.
    turn2 = client.chat.completions.create(
        model=model_id, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "What is a cache?"},
                  {"role": "assistant", "content": cold.choices[0].message.content},
                  {"role": "user", "content": "And a prefix?"}])
    assert turn2.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens - 2
    # The figures come with the worker's heartbeats (about one a second).
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        lines = [l for l in metrics.splitlines()
                 if l.startswith("mlxd_prompt_cache_tokens_reused_total{")]
        if (lines and float(lines[0].rsplit(" ", 1)[1]) >= 2 * cached
                or time.monotonic() > deadline):
            break
        time.sleep(0.2)

    def value(name):
        (line,) = [l for l in metrics.splitlines() if l.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])

    assert value("mlxd_prompt_cache_hits_total") >= 2
    assert value("mlxd_prompt_cache_misses_total") >= 1
    assert value("mlxd_prompt_cache_tokens_reused_total") >= 2 * cached
    assert value("mlxd_prompt_cache_bytes") > 0 and value("mlxd_prompt_cache_entries") >= 1
    assert value("mlxd_prompt_cache_evictions_total") >= 0


def test_the_responses_api_reports_cached_input_tokens(server, client, model_id):
    first = client.responses.create(model=model_id, instructions=SYSTEM, input="Hello there",
                                    max_output_tokens=16, temperature=0)
    follow = client.responses.create(model=model_id, instructions=SYSTEM, input="More please",
                                     previous_response_id=first.id, max_output_tokens=16,
                                     temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2


def test_prompt_cache_keys_separate_and_caches_never_cross_models(tiny_model, tmp_path):
    twin = tmp_path / "twin"
    shutil.copytree(tiny_model, twin)  # the same weights under another name
    with ServerProcess([str(tiny_model), str(twin)]) as srv:
        srv.wait_healthy()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chat(c, str(tiny_model), "Hi", max_tokens=2)
        assert chat(c, str(tiny_model), "Hi", max_tokens=2).usage.prompt_tokens_details \
            .cached_tokens > 0
        assert chat(c, str(twin), "Hi", max_tokens=2).usage.prompt_tokens_details \
            .cached_tokens == 0
        keyed = chat(c, str(tiny_model), "Hi", max_tokens=2, extra_body={
            "prompt_cache_key": "someone-else"})
        assert keyed.usage.prompt_tokens_details.cached_tokens == 0


def test_a_hybrid_models_next_turn_reports_cached_tokens(hybrid_model):
    """Recurrent layers (qwen3_next-type): the agent's next turn starts from the state
    the worker kept at the end of the first, and answers as a cold run would."""
    model = str(hybrid_model)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    with ServerProcess([model]) as srv:
        srv.wait_healthy()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        first = c.chat.completions.create(model=model, messages=turn1, max_tokens=8,
                                          temperature=0)
        turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "More"}]
        second = c.chat.completions.create(model=model, messages=turn2, max_tokens=8,
                                           temperature=0)
        cold = c.chat.completions.create(model=model, messages=turn2, max_tokens=8,
                                         temperature=0, extra_body={"prompt_cache_key": "cold"})
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == cold.choices[0].message.content


def test_a_hybrid_models_new_chat_with_the_same_system_prompt_reports_cached_tokens(
        hybrid_model):
    """Recurrent state cannot be trimmed back to a shared system prompt: the worker keeps
    the state where the first chat's system prompt ends (and the next user turn opens),
    so every new chat with it starts there, and answers as a cold
    run would."""
    model = str(hybrid_model)

    def chat(c, question, key=None):
        return c.chat.completions.create(
            model=model, max_tokens=6, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            extra_body={"prompt_cache_key": key} if key else None)

    with ServerProcess([model]) as srv:
        srv.wait_healthy()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        first = chat(c, "Hi")
        second = chat(c, "What is the weather like today?")
        third = chat(c, "Where is the nearest library?")
        cold = chat(c, "Where is the nearest library?", key="cold")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    shared = second.usage.prompt_tokens_details.cached_tokens
    assert 128 <= shared < second.usage.prompt_tokens - 4
    assert third.usage.prompt_tokens_details.cached_tokens >= shared
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert third.choices[0].message.content == cold.choices[0].message.content
