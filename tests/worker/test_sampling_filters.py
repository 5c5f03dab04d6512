"""top_p, min_p and top_k act on every sampled request, seeded or not (worker/text/sampling.py):
an unseeded request takes the shared, cached sampler, a seeded one its own; both must
filter. Each filter is set so that it keeps only the most likely token, which the
distribution below gives 30% of the mass: unfiltered, 200 draws would all land on it
with probability 0.3**200."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from tests.generates import generate
from tests.worker.test_worker_engine import gen, run
from worker.text.sampling import sampler_for

VOCAB = 8
BEST = 3
PROBS = [0.1] * VOCAB
PROBS[BEST] = 0.3
DRAWS = 200


def _draws(sampler) -> set[int]:
    row = mx.array([math.log(p) for p in PROBS])
    logprobs = mx.broadcast_to(row - mx.logsumexp(row), (DRAWS, VOCAB))
    return set(sampler(logprobs).tolist())


@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("only_best", [dict(top_k=1), dict(top_p=0.2), dict(min_p=0.5)],
                         ids=["top_k", "top_p", "min_p"])
def test_each_filter_keeps_only_what_it_allows(only_best, seed):
    sp = generate(temperature=1.0, seed=seed, **only_best).sampling
    assert _draws(sampler_for(sp, VOCAB)) == {BEST}


@pytest.mark.parametrize("seed", [None, 7])
def test_without_filters_the_draws_spread(seed):
    """The control: the same draws unfiltered do not all land on the best token."""
    sp = generate(temperature=1.0, seed=seed).sampling
    assert len(_draws(sampler_for(sp, VOCAB))) > 1


def test_an_unseeded_top_k_of_one_is_greedy_through_the_engine(engine):
    greedy = run(engine, gen(max_tokens=20, temperature=0.0))[1]
    assert run(engine, gen(max_tokens=20, temperature=1.5, top_k=1))[1] == greedy
