"""What a verification must earn, measured on the device at load (worker/speculative/
cost.py `verify_price`, adaptive.py `Pace.price`): a sequence whose drafts do not pay for
the verify step on this device rests from drafting, with the same text."""

from __future__ import annotations

import math

import pytest

from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from tests.worker.test_speculative import REPEATING, ids
from worker.loading.startup import price_verification
from worker.speculative.adaptive import MIN_GAIN, Pace
from worker.speculative.cost import verify_costs, verify_price


def test_a_verification_priced_on_the_device_rests_what_the_fixed_price_keeps():
    """Prose on a lent H200: 0.87 tokens accepted a verification, a verify step 1.86
    plain ones there. The fixed price keeps such a sequence drafting; the measured one
    rests it."""
    fixed, priced = Pace(8), Pace(8, verify=(0.86, 0.79))
    for pace in (fixed, priced):
        pace.update(1, 1)
        pace.update(1, 0)   # gain 0.5: over MIN_GAIN, under the measured price
    assert fixed.wants() and not priced.wants()
    # Between a draft of one and of max_draft, by length.
    p = Pace(8, verify=(0.5, 1.2))
    assert (p.price(1), p.price(8), p.price(12)) == (0.5, pytest.approx(1.2), pytest.approx(1.2))
    assert p.price(5) == pytest.approx(0.5 + 0.7 * 4 / 7)
    assert Pace(8).price(3) == MIN_GAIN and Pace(1, verify=(0.7, 0.9)).price(1) == 0.7


def test_the_price_is_measured_on_the_model_and_never_under_the_fixed_one(engine):
    costs = verify_costs(engine.model, (1, 4), reps=2)
    assert set(costs) == {1, 4} and all(math.isfinite(c) and c >= 0 for c in costs.values())
    one, most = verify_price(engine.model, 8)
    assert one >= MIN_GAIN and most >= MIN_GAIN
    assert verify_price(engine.model, 0) is None


def test_a_model_whose_cache_cannot_give_positions_back_keeps_the_fixed_price(hybrid_engine):
    assert verify_costs(hybrid_engine.model, (4,)) is None
    assert verify_price(hybrid_engine.model, 8) is None


def _lookup(engine, price):
    b = make_batch(engine, speculative="prompt-lookup")
    price_verification(b, engine)   # (as a worker's load does)
    measured = b.speculation.verify_price
    b.speculation.verify_price = price
    seq = Seq("lookup")
    b.add(seq, engine.prepare(generate(rid="lookup", prompt=REPEATING, max_tokens=80,
                                       temperature=0.0)))
    out = []
    while b.members:
        out += [o for _, o in b.step()]
    return ids(out), b.speculation.totals.verifications, measured


def test_a_batch_prices_its_verifications_and_a_dear_price_rests_its_drafts(engine):
    cheap, cheap_steps, measured = _lookup(engine, None)
    assert measured is not None and min(measured) >= MIN_GAIN  # (price_verification set it)
    dear, dear_steps, _ = _lookup(engine, (6.0, 6.0))   # no draft earns 6 tokens here
    assert dear == cheap                                 # the same text
    assert cheap_steps >= 4 and dear_steps < cheap_steps / 2


def test_a_verification_that_cannot_be_timed_leaves_the_fixed_price(engine, monkeypatch,
                                                                   caplog):
    def broken(model, drafts):
        raise RuntimeError("no kernel for this shape")
    monkeypatch.setattr("worker.speculative.cost.verify_costs", broken)
    b = make_batch(engine, speculative="prompt-lookup")
    b.speculation.verify_price = (9.0, 9.0)
    price_verification(b, engine)
    assert b.speculation.verify_price is None and "could not time" in caplog.text
