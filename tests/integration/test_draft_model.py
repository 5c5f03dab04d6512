"""`--draft-model` through real processes: the setting reaches each worker (its flag, from
the server's), the worker loads the draft beside its model (the `small` random model,
drafted by `tiny`: another model with the same tokenizer, a fraction of its step), drafts
are verified, and the text at temperature 0 is the one the same model gives without a
draft (decoded in this process: tests/conftest.py gives it the workers' BLAS)."""

from __future__ import annotations

import httpx

from tests.generates import generate
from tests.integration.test_faults import wait_for, worker
from tests.serverproc import ServerProcess
from tests.worker.batchrun import make_batch, steps


def test_a_server_with_a_draft_model_drafts_and_gives_the_text_it_gives_without(
        tiny_model, models_dir):
    from worker.demos.text import build_model
    from worker.loading import models
    from worker.text.engine import TextEngine

    model = str(build_model(models_dir / "small", "small").path)
    req = dict(prompt="word one two three " * 10, temperature=0.0, max_tokens=30)
    loaded = models.load(model, models_dir)
    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 512,
                        loaded.vocab_size)
    want = "".join(o[1] for o in steps(engine, engine.prepare(generate("w", **req)),
                                       make_batch(engine)) if o)
    with ServerProcess([model], "--draft-model", str(tiny_model),
                       "--heartbeat-interval", "0.05") as srv:
        srv.wait_healthy()
        got = httpx.post(srv.url + "/v1/completions", json={"model": model, **req},
                         timeout=120).json()
        # (Its next heartbeats; the two warm-up requests of 2 tokens drafted 2 at most. A
        # wide wait: on a busy CI machine one run missed 10 s. Failing, it says what the
        # health report last held and what the worker logged of its draft.)
        seen = []
        try:
            spec = wait_for(lambda: seen.append(worker(srv).get("speculation")) or (
                s := seen[-1] or {}).get("drafted", 0) > 2 and s, 60)
        except AssertionError:
            drafts = [line for line in srv.log_path.read_text().splitlines() if "draft" in line]
            raise AssertionError(f"no drafts reported: last {seen[-1:]}; log: {drafts[-5:]}")
    assert got["choices"][0]["text"] == want
    assert got["usage"]["completion_tokens"] == 30 and spec["verifications"] > 0
