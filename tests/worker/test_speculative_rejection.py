"""Rejection sampling over a draft's distribution (worker/speculative/rejection.py) inside
the batch, on the tiny float32 model: sampled texts follow the target's own distribution
(the first tokens of many seeded samples against the distribution computed from the
model, a test that fails when the acceptance rule, the residual or the bonus token is
wrong), more of the draft is kept than matching the target's own sample keeps, a seed
reproduces, and temperature 0 is exactly greedy. The draft is the target's own logits
with its favourite lowered (`Demoted`): close to p but not p, so drafts are both kept
and rejected."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.generates import generate
from tests.worker.batchrun import make_batch, run_all
from tests.worker.test_speculative import ids, run
from tests.worker.test_speculative_mtp import mtp  # noqa: F401 (a fixture)
from worker.speculative import rejection
from worker.speculative.adaptive import Speculation
from worker.speculative.draft_model import DraftModel

K = 3        # tokens compared: the first is the prefill's, the next two drafted/verified
TOP_K = 2    # the support of each position's distribution: 8 outcomes for K = 3
SAMPLES = 300
# Chi-squared at 7 degrees of freedom (8 outcomes) exceeds this with probability 1e-4
# (scipy's chi2.isf(1e-4, 7)); the seeds are fixed, so the test is deterministic.
CHI2_LIMIT = 29.88
PROMPT = "Hi there"


class Demoted:
    """A draft model whose q differs from p: the target's logits with its favourite
    token lowered by `by` (a draft that is often, not always, rejected)."""

    def __init__(self, model, by: float):
        self.model, self.layers, self.by = model, model.layers, by

    def __call__(self, inputs, cache=None):
        logits = self.model(inputs, cache=cache)
        top = logits == logits.max(axis=-1, keepdims=True)
        return logits - self.by * top


def exact(engine, prep) -> dict:
    """{first K tokens: probability} under the target's own sampling distribution (its
    logits processors, then its sampling chain)."""
    rs = rejection.RowSampling(prep.gen.sampling, engine.vocab_size)
    processors = engine.processors(prep)
    out = {}

    def walk(prefix: tuple, prob: float):
        if len(prefix) == K:
            out[prefix] = prob
            return
        context = mx.array(list(prep.ids) + list(prefix))
        logits = engine.model(context[None])[:, -1]
        for processor in processors:
            logits = processor(context, logits)
        logits = logits[0]
        p = mx.exp(rejection.distribution([rs], (logits - mx.logsumexp(logits))[None]))
        p = p[0].tolist()
        for tok, pt in enumerate(p):
            if pt > 0:
                walk(prefix + (tok,), prob * pt)
    walk((), 1.0)
    return out


def sample(engine, draft, n: int = SAMPLES, **kw) -> list[tuple]:
    """The first K tokens of `n` seeded samples, all in one batch; speculation totals in
    `sample.totals`."""
    b = make_batch(engine, max_size=n, prefill_batch=n, draft=DraftModel(draft, 64),
                   max_draft=1)  # (t2 verified, t3 the bonus where t2 was kept)
    preps = {i: engine.prepare(generate(rid=str(i), prompt=PROMPT, max_tokens=K,
                                        temperature=1.0, top_k=TOP_K, seed=i, **kw))
             for i in range(n)}
    outs = run_all(b, preps)
    sample.totals = b.speculation.totals
    return [tuple(ids(outs[i])) for i in range(n)]


def chi2(engine, samples: list[tuple], **kw) -> float:
    probs = exact(engine, engine.prepare(generate(prompt=PROMPT, temperature=1.0,
                                                  top_k=TOP_K, **kw)))
    assert len(probs) == TOP_K ** K and abs(sum(probs.values()) - 1) < 1e-4
    counts = {k: 0 for k in probs}
    for s in samples:
        if s not in counts:  # (a token the target's top_k never samples there)
            return float("inf")
        counts[s] += 1
    n = len(samples)
    return sum((counts[k] - n * p) ** 2 / (n * p) for k, p in probs.items())


@pytest.mark.parametrize("bias", [(), ((17, 1.5),)])
def test_sampled_text_follows_the_targets_own_distribution(engine, bias):
    """Also with a logit_bias, which shapes p at each drafted position and not q (the
    rule is exact whatever q is)."""
    samples = sample(engine, Demoted(engine.model, 2.0), logit_bias=bias)
    t = sample.totals
    assert t.drafted >= SAMPLES and 0 < t.accepted < t.drafted  # (kept and rejected)
    assert chi2(engine, samples, logit_bias=bias) < CHI2_LIMIT


@pytest.mark.parametrize("broken", ["every draft kept", "no residual"])
def test_the_distribution_test_fails_with_a_broken_rule(engine, monkeypatch, broken):
    """The same test against rules that are wrong: each is over the limit (every draft
    kept: tokens the target's top_k never samples; drawing from p instead of the
    residual: 79 against 29.9). (A bonus token drawn from q fails it too: not kept, each
    run costs seconds.)"""
    right = rejection.accept

    def wrong(rows, logprobs, drafts, lengths, logq):
        kept, tokens = right(rows, logprobs, drafts, lengths, logq)
        k = drafts.shape[1]
        if broken == "every draft kept":
            kept = mx.ones_like(kept)
        else:  # (no residual: p where the residual should be drawn from)
            logp = rejection.distribution(rows, logprobs[:, :k])
            drawn = rejection.sample(logp, rejection.keys(rows)[:, :k])
            tokens = mx.concatenate([drawn, tokens[:, k:]], axis=1)
        return kept, tokens

    monkeypatch.setattr(rejection, "accept", wrong)
    assert chi2(engine, sample(engine, Demoted(engine.model, 2.0))) > CHI2_LIMIT


@pytest.mark.parametrize("drafter", ["draft model", "mtp"])
def test_rejection_sampling_keeps_more_of_the_draft_than_matching_the_sample(
        engine, mtp, monkeypatch, drafter):
    """The same seeded, sampled requests with the same drafter: min(1, p/q) keeps more
    than the target's own sample matching the drafter's greedy guess does."""
    if drafter == "mtp":
        engine, head, _ = mtp
        batch = dict(speculative="mtp", mtp_head=head)
    prompt = "Hello there " * 4
    reqs = {str(i): dict(prompt=prompt, max_tokens=24, temperature=1.0, seed=i)
            for i in range(8)}
    rates = {}
    for mode in (True, False):
        monkeypatch.setattr(Speculation, "rejection", mode)
        if drafter != "mtp":  # (the target drafting for itself: q is p)
            batch = dict(draft=DraftModel(engine.model, 64))
        run(engine, reqs, max_size=8, **batch)
        rates[mode] = run.totals.accepted / run.totals.drafted
    assert rates[True] > rates[False] + 0.1, rates
    if drafter != "mtp":  # (q is p: every draft kept)
        assert rates[True] > 0.95, rates


def test_a_seeded_request_reproduces_and_temperature_zero_is_greedy(engine):
    draft = Demoted(engine.model, 2.0)
    req = {"s": dict(prompt=PROMPT, max_tokens=30, temperature=0.8, top_p=0.95, seed=11)}
    first, _, _ = run(engine, req, draft=DraftModel(draft, 64))
    t = run.totals
    assert 0 < t.accepted < t.drafted
    second, _, _ = run(engine, req, draft=DraftModel(draft, 64))
    assert ids(first["s"]) == ids(second["s"])
    greedy = {"g": dict(prompt=PROMPT, max_tokens=30, temperature=0.0)}
    plain, _, _ = run(engine, greedy)
    drafted, _, _ = run(engine, greedy, draft=DraftModel(draft, 64))
    assert run.totals.drafted > 0
    assert ids(drafted["g"]) == ids(plain["g"])


def test_q_gets_the_logit_bias_and_keeps_more_of_the_draft(engine, monkeypatch):
    """The target drafting for itself with a strong logit_bias: with the bias on q too, q
    is p and every draft is kept; without it (the bias only on p) far fewer are. (That
    the text stays the target's distribution with a bias: the chi-squared test above.)"""
    reqs = {str(i): dict(prompt="Hello there " * 4, max_tokens=16, temperature=1.0,
                         seed=i, logit_bias=((17, 6.0), (29, 6.0)))
            for i in range(4)}
    rates = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(rejection.RowSampling, "bias",
                                lambda self, vocab: mx.zeros((vocab,)))
        run(engine, reqs, max_size=4, draft=DraftModel(engine.model, 64))
        rates[on] = run.totals.accepted / run.totals.drafted
    assert rates[True] > 0.95 and rates[False] < rates[True] - 0.1, rates
