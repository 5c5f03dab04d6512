"""`--draft-model` through real processes: the setting reaches each worker (its flag, from
the server's), the worker loads the draft beside its model, and the text at temperature 0
is the one a server without the draft gives. The tiny model drafts for itself, so every
draft is accepted (worker/speculative/draft_model.py)."""

from __future__ import annotations

import httpx

from tests.integration.test_faults import wait_for, worker
from tests.serverproc import ServerProcess


def test_a_server_with_a_draft_model_gives_the_same_text_with_every_draft_accepted(
        tiny_model, server):
    model = str(tiny_model)
    body = {"model": model, "prompt": "Hi there", "temperature": 0, "max_tokens": 40}
    want = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    with ServerProcess([model], "--draft-model", model, "--heartbeat-interval", "0.05") as srv:
        srv.wait_healthy()
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        # (Its next heartbeats; the two warm-up requests of 2 tokens drafted 2 at most.)
        spec = wait_for(lambda: (s := worker(srv).get("speculation") or {}).get(
            "drafted", 0) > 2 and s, 10)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    # (A draft that is the model costs a whole step per token: its sequence drafts, every
    # draft accepted, then rests: adaptive.py's Pace.)
    assert spec["accepted"] == spec["drafted"]
