"""A legacy completion's `echo` with logprobs in-process (worker/loop/echo.py): the prompt
scored chunk by chunk as one pass of the model scores it, and the state the scoring
leaves continues the sequence in the batch exactly as an ordinary prefill would."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from tests.generates import generate
from tests.worker.batchrun import make_batch, run_all
from worker.loop import echo

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away " * 3


def reference(model, ids: list[int], k: int) -> list:
    """Per prompt token after the first: (its logprob, the best k logprobs), one pass."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = []
    for i in range(1, len(ids)):
        row = lp[i - 1]
        rows.append((row[ids[i]].item(), sorted(row.tolist(), reverse=True)[:k]))
    return rows


@pytest.mark.parametrize("step,k", [(5, 3), (64, 1), (4096, 3), (64, 0)])
def test_a_prompt_scored_chunk_by_chunk_equals_one_pass(engine, step, k):
    from mlx_lm.models.cache import make_prompt_cache

    ids = engine.prepare(generate(prompt=PROMPT)).ids
    cache = make_prompt_cache(engine.model)
    rows = echo.score(engine.model, ids, cache, k, step, engine.vocab_size)
    assert len(rows) == len(ids) and math.isnan(rows[0][0]) and rows[0][1] == []
    assert cache[0].offset == len(ids) - 1  # all but the last token, for the batch
    for i, ((lp, top), (want, best)) in enumerate(zip(rows[1:], reference(
            engine.model, ids, k)), 1):
        assert lp == pytest.approx(want, abs=1e-4), i
        assert [v for _, v in top] == pytest.approx(best, abs=1e-4), i
        assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))


def test_a_scored_prompt_continues_as_it_would_unscored_beside_others(engine):
    """The scored request's tokens and logprobs equal the same request's without echo,
    in a batch with two others that are unchanged too; the prompt's rows come on its
    Prepared, one per prompt token."""
    def gen(name, prompt, **kw):
        return generate(rid=name, prompt=prompt, max_tokens=12, temperature=0.0, **kw)

    others = {"b": "Hi", "c": "word " * 30}
    plain = run_all(make_batch(engine), {
        "a": engine.prepare(gen("a", PROMPT, logprobs=True, top_logprobs=2)),
        **{n: engine.prepare(gen(n, p)) for n, p in others.items()}})
    scored_prep = engine.prepare(gen("a", PROMPT, logprobs=True, top_logprobs=2, echo=True))
    scored = run_all(make_batch(engine), {
        "a": scored_prep, **{n: engine.prepare(gen(n, p)) for n, p in others.items()}})
    for name in ("a", *others):
        assert [o[:3] for o in scored[name]] == [o[:3] for o in plain[name]], name
    assert [o[3].logprob for o in scored["a"]] == pytest.approx(
        [o[3].logprob for o in plain["a"]], abs=1e-4)
    assert len(scored_prep.echo) == len(scored_prep.ids)
    packed = echo.delta(engine, scored_prep, 1, "a")
    rows = packed.logprob_rows()
    assert len(rows) == len(scored_prep.ids) and packed.n_tokens == 0
    assert packed.text == PROMPT
    assert math.isnan(rows[0][1]) and all(len(top) == 2 for _, _, top in rows)
    assert [lp for _, lp, _ in rows[1:]] == pytest.approx(
        [lp for lp, _ in scored_prep.echo[1:]], abs=1e-6)


def test_a_raw_prompts_logprobs_end_with_the_eos_that_stopped_it(engine):
    """A raw prompt's logprobs carry the EOS token's row (its text never in the output);
    a chat's do not: OpenAI's legacy completions report the token that stopped them, its
    chat completions do not."""
    from tests.worker.batchrun import steps

    eos = next(iter(engine.eos))
    kw = dict(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=1,
              logit_bias=((eos, 100.0),))
    raw = [o for o in steps(engine, engine.prepare(generate(prompt="Hi", **kw))) if o]
    chat = [o for o in steps(engine, engine.prepare(generate(
        messages=[{"role": "user", "content": "Hi"}], **kw))) if o]
    (tok, text, finish, extra), = raw
    assert (tok, text, finish) == (-1, "", "stop")
    assert extra.logprob > -1.0 and extra.token_bytes[0] == engine.token_bytes(eos)
    (tok, text, finish, extra), = chat
    assert (tok, finish) == (-1, "stop") and (extra is None or extra.logprob is None)
