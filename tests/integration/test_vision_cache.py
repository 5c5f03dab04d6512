"""A vision model's prompt cache and KV snapshots end to end (worker/vision/batch.py on the
KV cache manager): the real supervisor and worker with the official openai client on the
tiny Qwen2-VL. A text turn and an image turn sent again are reused and say so in
`cached_tokens`; the same words about another image are not; a Responses chain about
one image resumes past the image from the disk tier after `mlxctl kill` and after mlxd
restarted, and answers as the same conversation prefilled cold."""

from __future__ import annotations

import openai
import pytest

from tests.integration.test_faults import wait_for
from tests.integration.test_mlxctl import mlxctl, ok
from tests.integration.test_snapshots import stats
from tests.integration.test_vision import ask, data_url
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cserver(vision_model, tmp_path_factory):
    with ServerProcess([str(vision_model)],
                       state_dir=tmp_path_factory.mktemp("vision-state")) as srv:
        srv.wait_healthy(timeout=120)
        yield srv


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)


def chat(client, model, messages, key):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                          temperature=0, extra_body={"prompt_cache_key": key})


def cached(r) -> int:
    """A chat completion's or a response's cached prompt tokens."""
    details = getattr(r.usage, "prompt_tokens_details", None) or r.usage.input_tokens_details
    return details.cached_tokens


def test_text_and_image_turns_are_reused_and_another_image_is_not(cserver, vision_model):
    client, model = client_of(cserver), str(vision_model)
    text = [{"role": "user", "content": "Tell me a long story about boats " * 20}]
    first, again = chat(client, model, text, "t"), chat(client, model, text, "t")
    assert cached(first) == 0 and cached(again) >= first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content

    image = ask(data_url(seed=11))
    first, again = chat(client, model, image, "i"), chat(client, model, image, "i")
    assert cached(first) == 0 and cached(again) >= first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    # The same words about another image (the same token ids): reused up to the image.
    other = chat(client, model, ask(data_url(seed=12)), "i")
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert 0 < cached(other) < first.usage.prompt_tokens - 4  # (4 image tokens, then more)


def respond(client, model, content, previous=None, **kw):
    return client.responses.create(model=model, input=content, previous_response_id=previous,
                                   max_output_tokens=6, temperature=0, **kw)


def from_disk(counters: dict) -> None:
    """The turn started from the snapshot its previous_response_id names, read from disk:
    whole, or (counted as a fallback) the part its prompt shares with it, which the tiny
    model's replies make the usual case: rendered back into the next prompt, they need
    not tokenize as they were generated (the Responses chain of test_snapshots.py runs a
    real tokenizer to see whole hits)."""
    assert counters["disk_read_bytes"] > 0
    assert counters["hits_disk"] + counters["fallbacks"] == 1 and counters["misses"] == 0


def test_a_chain_about_one_image_resumes_after_a_kill_and_a_restart(vision_model, tmp_path):
    model, url = str(vision_model), data_url(seed=21)
    opening = [{"role": "user", "content": [
        {"type": "input_text", "text": "What is in the picture?"},
        {"type": "input_image", "image_url": url}]}]
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy(120)
        client = client_of(srv)
        turns = [respond(client, model, opening)]
        stats(srv, disk_entries=1)
        pid = srv.worker_pids()[0]
        ok(mlxctl(srv, "kill"))
        wait_for(lambda: (pids := srv.worker_pids()) and pids[0] != pid, 60)
        srv.wait_healthy(120)
        turns.append(respond(client, model, "And its colours?", turns[-1].id))
        from_disk(stats(srv, disk_entries=2))
    with ServerProcess([model], state_dir=tmp_path) as srv:
        srv.wait_healthy(120)
        client = client_of(srv)
        turns.append(respond(client, model, "And its shapes?", turns[-1].id))
        from_disk(stats(srv, disk_entries=3))
        for before, after in zip(turns, turns[1:]):  # resumed past the image, and more
            assert cached(after) >= before.usage.input_tokens
        items = opening + [{"role": "assistant", "content": turns[0].output_text},
                           {"role": "user", "content": "And its colours?"},
                           {"role": "assistant", "content": turns[1].output_text},
                           {"role": "user", "content": "And its shapes?"}]
        cold = respond(client, model, items, store=False,
                       extra_body={"prompt_cache_key": "cold"})
        assert cached(cold) == 0 and cold.usage.input_tokens == turns[2].usage.input_tokens
        assert cold.output_text == turns[2].output_text
