"""`--draft-model` through real processes: the setting reaches each worker (its flag, from
the server's), the worker loads the draft beside its model (the `small` random model,
drafted by `tiny`: another model with the same tokenizer, a fraction of its step), and a
request that drafts gets the text of one that may not (a logit_bias of 0: a logits
processor, which never drafts, changing nothing)."""

from __future__ import annotations

import httpx

from tests.integration.test_faults import wait_for, worker
from tests.serverproc import ServerProcess


def test_a_server_with_a_draft_model_drafts_and_gives_the_text_it_gives_without(
        tiny_model, models_dir):
    from worker.demos.text import build_model

    model = str(build_model(models_dir / "small", "small").path)
    body = {"model": model, "prompt": "word one two three " * 10, "temperature": 0,
            "max_tokens": 30}
    with ServerProcess([model], "--draft-model", str(tiny_model),
                       "--heartbeat-interval", "0.05") as srv:
        srv.wait_healthy()
        drafted = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        # (Its next heartbeats; the two warm-up requests of 2 tokens drafted 2 at most.)
        spec = wait_for(lambda: (s := worker(srv).get("speculation") or {}).get(
            "drafted", 0) > 2 and s, 10)
        plain = httpx.post(srv.url + "/v1/completions", json={**body, "logit_bias": {"5": 0}},
                           timeout=120).json()
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert drafted["usage"]["completion_tokens"] == 30
    assert spec["verifications"] > 0
