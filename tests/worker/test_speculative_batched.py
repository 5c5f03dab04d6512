"""Rejection sampling as one batched rule (worker/speculative/rejection.py, verify.py): a
verify step reads the device once for all its rows, however many there are (on a GPU each
read waits for the device: a read per row cost more than the drafts saved), and a
seeded row draws the same text whichever rows share its steps (its keys are its own, at
fixed slots, however long its batch-mates' drafts are). On the tiny float32 model with the
`Demoted` draft of test_speculative_rejection (drafts both kept and rejected)."""

from __future__ import annotations

import mlx.core as mx

from tests.worker.test_speculative import ids, run
from tests.worker.test_speculative_rejection import PROMPT, Demoted
from worker.speculative import verify
from worker.speculative.draft_model import DraftModel

ME = dict(prompt=PROMPT, max_tokens=24, temperature=0.8, top_p=0.95, seed=5)
OTHERS = {
    "a": dict(prompt="Hello there " * 3, max_tokens=30, temperature=1.0, seed=1),
    "b": dict(prompt="Once upon", max_tokens=16, temperature=0.5, top_k=5, seed=2),
    "g": dict(prompt=PROMPT, max_tokens=20, temperature=0.0),   # greedy match
}


def reads_per_step(engine, monkeypatch, requests: dict) -> list[int]:
    """The device reads (`mx.eval`, `tolist`, `item`) of each verify step of `requests`
    where no sequence ended (one that ends hands its cache over: worker/loop's reads)."""
    counts, now = [], [0]

    def counting(f):
        def read(*a, **kw):
            now[0] += 1
            return f(*a, **kw)
        return read

    monkeypatch.setattr(mx, "eval", counting(mx.eval))
    monkeypatch.setattr(mx.array, "tolist", counting(mx.array.tolist))
    monkeypatch.setattr(mx.array, "item", counting(mx.array.item))
    right = verify.verify

    def step(gb, spec):
        now[0] = 0
        out = right(gb, spec)
        if not any(r.finish_reason for r in out or ()):
            counts.append(now[0])
        return out

    monkeypatch.setattr(verify, "verify", step)
    run(engine, requests, max_size=len(requests),
        draft=DraftModel(Demoted(engine.model, 2.0), 64))
    monkeypatch.undo()
    assert 0 < run.totals.accepted < run.totals.drafted
    return counts


def test_a_verify_step_reads_the_device_as_often_with_four_rows_as_with_one(
        engine, monkeypatch):
    """Four rows (three verified by rejection sampling, one by greedy match) read no more
    than one does: the pending tokens (an eval, then a tolist), the draft, and the
    verification's one read (a first step also prefills the draft model)."""
    one = reads_per_step(engine, monkeypatch, {"me": ME})
    four = reads_per_step(engine, monkeypatch, {"me": ME, **OTHERS})
    assert len(four) > 5
    assert max(four) <= max(one) <= 5 and max(four[1:]) <= 4, (one, four)


def test_a_seeded_request_draws_the_same_text_alone_and_in_a_batch(engine):
    draft = Demoted(engine.model, 2.0)
    alone, _, _ = run(engine, {"me": ME}, draft=DraftModel(draft, 64))
    assert 0 < run.totals.accepted < run.totals.drafted
    together, _, _ = run(engine, {"me": ME, **OTHERS}, max_size=4,
                         draft=DraftModel(draft, 64))
    assert ids(together["me"]) == ids(alone["me"])
    again, _, _ = run(engine, {**OTHERS, "me": ME}, max_size=4, draft=DraftModel(draft, 64))
    assert ids(again["me"]) == ids(alone["me"])
