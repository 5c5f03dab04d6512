"""--kv-bits end to end: the real supervisor and an 8-bit KV worker (its model's own
--model-setting over the server's --kv-bits) answer the official client, batched requests give what each gives alone, and mlxctl status and /metrics show
the format, the bytes one token takes and the tokens held."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.test_faults import wait_for
from tests.integration.test_mlxctl import mlxctl, ok
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration

PROMPTS = ["Once upon a time", "The quick brown fox", "Hi", "word " * 30]


@pytest.fixture(scope="module")
def kvq_model(models_dir):
    from worker.demos.text import build_model

    return build_model(models_dir / "tiny-kvq", "tiny-kvq").path  # heads of 32


def held_kv(srv) -> dict:
    """The worker's KV figures once it has held tokens: they come with its heartbeat,
    which need not have come since the last answer."""
    def kv():
        (w,) = json.loads(ok(mlxctl(srv, "status", "--json")).stdout)["workers"]
        return w["kv"]

    wait_for(lambda: (kv() or {}).get("tokens", 0) > 0, 20, interval=0.3)
    return kv()


def test_an_8_bit_kv_worker_serves_batches_and_shows_its_bytes_per_token(kvq_model):
    # (The server's format is 4 bits in groups of 64; this model's own settings, 8 bits in
    # groups of 32, are what its worker runs with.)
    with ServerProcess([str(kvq_model)], "--kv-bits", "4", "--model-setting",
                       f"{kvq_model}:kv_bits=8", "--model-setting",
                       f"{kvq_model}:kv_group_size=32") as srv:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        model = str(kvq_model)

        def ask(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                             temperature=0).choices[0].text

        alone = [ask(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(ask, PROMPTS))
        assert together == alone and all(alone)

        # Predicted Outputs on the quantized cache: drafts verified and kept, the text
        # the same (tests/worker/test_speculative_kv_quant.py).
        def chat(**kw):
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=24, temperature=0, **kw)

        plain = chat()
        predicted = chat(prediction={"type": "content",
                                     "content": plain.choices[0].message.content})
        assert predicted.choices[0].message.content == plain.choices[0].message.content
        details = predicted.usage.completion_tokens_details
        # (A random model's text does not tokenize back as it was generated, so only
        # parts of it are found again: tests/integration/test_predicted_outputs.py has
        # the trained model's whole counts.)
        assert details.accepted_prediction_tokens > 0, details

        # Float32 keys and values of 2 layers x 2 heads x 32: 1024 bytes a token at full
        # precision; 8 bits in groups of 32 with a float32 scale and bias: 10/32 of it.
        stats = held_kv(srv)
        assert stats["bits"] == 8 and stats["bytes_per_token"] == 1024 * 10 / 32
        assert stats["bytes"] >= stats["tokens"] * stats["bytes_per_token"]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert f'mlxd_kv_bytes_per_token{{bits="8",model="{model}"}} 320.0' in metrics
        assert "mlxd_kv_tokens_held{" in metrics


def test_a_vision_checkpoint_serves_images_on_an_8_bit_kv_cache(models_dir):
    # (Gemma 3's layout with heads of 32: its global layers quantized, its windows not;
    # worker/vision/batch.py `_carry` hands an image's prefill over quantized.)
    from tests.integration.test_vision import ask, data_url
    from tests.integration.test_vision_cache import cached
    from worker.demos.vision import build_vision_model

    path = build_vision_model(models_dir / "tiny-kvq-vision-gemma3", "tiny-kvq",
                              family="gemma3").path
    model = str(path)
    with ServerProcess([model], "--kv-bits", "8", "--kv-group-size", "32") as srv:
        srv.wait_healthy(timeout=120)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

        def chat(url, text):
            return client.chat.completions.create(
                model=model, messages=ask(url, text), max_tokens=6, temperature=0,
                extra_body={"prompt_cache_key": "k"})

        words = "Describe this picture in detail, please: " * 3
        first = chat(data_url(seed=1), words)
        again, other = chat(data_url(seed=1), words), chat(data_url(seed=2), words)
        assert first.usage.completion_tokens == 6 and cached(first) == 0
        assert cached(again) >= first.usage.prompt_tokens - 1
        assert again.choices[0].message.content == first.choices[0].message.content
        assert 0 < cached(other) < first.usage.prompt_tokens - 4  # (the words before it)
        assert held_kv(srv)["bits"] == 8


def test_a_text_scored_through_echo_reads_the_8_bit_cache(real_server, smollm2_gguf,
                                                          tmp_path_factory):
    # Perplexity through the API, as lm-evaluation-harness reads a text (`echo`,
    # `logprobs`, no new tokens), on the real model with an 8-bit KV worker: each prompt
    # token's logprob is computed over the worker's own KV format (worker/loop/batch.py
    # `scored`: a fresh cache of the batch's format), so it differs from a full-precision
    # worker's, and the text's perplexity stays within 1 % of it (bench/kv_quant.py's
    # goal for 8 bits; +0.06 % measured on 1,437 tokens).
    import math
    from pathlib import Path

    from tests.realmodel import serving_demo

    text = (Path(__file__).parents[2] / "bench" / "texts" / "genesis-1-4-kjv.txt").read_text()

    def scored(srv) -> list[float]:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model="demo", prompt=text[:2000], max_tokens=0,
                                        echo=True, logprobs=1)
        rows = got.choices[0].logprobs.token_logprobs
        assert rows[0] is None and got.choices[0].text == text[:2000]
        return rows[1:]

    def perplexity(rows):
        return math.exp(-sum(rows) / len(rows))

    full = scored(real_server)
    with serving_demo(smollm2_gguf, tmp_path_factory, "--kv-bits", "8") as srv:
        eight = scored(srv)
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'mlxd_kv_bytes_per_token{bits="8",model="demo"}' in metrics
    assert len(eight) == len(full) > 300
    assert sum(a != b for a, b in zip(eight, full)) > len(full) // 2
    assert abs(perplexity(eight) / perplexity(full) - 1) < 0.01
