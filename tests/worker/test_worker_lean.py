"""worker/loop/lean.py: a lone stream's decode steps skip mlx-lm's prompt bookkeeping and
per-row loops, and give exactly what mlx-lm's own methods give (tokens, logprobs, seeded
samples); a batch of several, or one with logits processors, keeps mlx-lm's methods."""

from __future__ import annotations

import pytest

from tests.generates import generate
from tests.worker.batchrun import make_batch, run_all, steps
from worker.loop import lean

PROMPT = "Once upon a time there was a little model"


def counted(monkeypatch) -> dict:
    """Calls of mlx-lm's own `_next` and `_step` (what the lean ones fall back to)."""
    calls = {"next": 0, "step": 0}
    for name, own in list(lean.ORIGINAL.items()):
        def spy(self, _own=own, _name=name):
            calls[_name] += 1
            return _own(self)
        monkeypatch.setitem(lean.ORIGINAL, name, spy)
    return calls


def run(engine, **kw):
    g = generate(rid="x", prompt=PROMPT, max_tokens=20, **kw)
    return [o for o in steps(engine, engine.prepare(g)) if o is not None]


@pytest.mark.parametrize("kw", [dict(temperature=0.0, logprobs=True, top_logprobs=2),
                                dict(temperature=0.8, seed=7)])
def test_a_lone_stream_decodes_leanly_and_as_mlx_lm_does(engine, monkeypatch, kw):
    calls = counted(monkeypatch)
    lean_out = run(engine, **kw)
    assert calls["step"] == 0  # every decode step was the lean one
    assert calls["next"] <= 2  # the prompt's steps only (then nothing is prefilled)
    with monkeypatch.context() as m:
        m.setattr(lean, "ON", False)  # mlx-lm's own methods: the reference
        own = run(engine, **kw)
    assert [o[0] for o in lean_out] == [o[0] for o in own] and len(own) == 20
    assert "".join(o[1] for o in lean_out) == "".join(o[1] for o in own)
    if kw.get("logprobs"):
        for a, b in zip(lean_out, own):
            assert a[3].logprob == pytest.approx(b[3].logprob, abs=1e-5)
            assert [t for t, _ in a[3].top] == [t for t, _ in b[3].top]


def test_several_streams_or_logits_processors_keep_mlx_lms_step(engine, monkeypatch):
    calls = counted(monkeypatch)
    run(engine, temperature=0.0, repetition_penalty=1.3)  # a processor: mlx-lm's step
    assert calls["step"] > 0
    calls["step"] = 0
    preps = {n: engine.prepare(generate(rid=n, prompt=p, max_tokens=6, temperature=0.0))
             for n, p in (("a", PROMPT), ("b", "Hi"))}
    out = run_all(make_batch(engine), preps)
    assert calls["step"] > 0 and all(len(v) == 6 for v in out.values())
