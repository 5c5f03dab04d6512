"""What a verification step costs where it runs (worker/speculative/cost.py), driven by
made-up step times: a sequence whose accepted tokens do not pay for a verify step that
costs 3 plain steps rests (and still probes now and then), one whose verify step costs
1.1 steps keeps drafting; the prior holds until both kinds of step were timed; in a batch
the rows drafting share the price of the verify step every row pays; and the real batch
times its own steps, its text unchanged whatever the price."""

from __future__ import annotations

import pytest

from tests.worker.test_speculative import REPEATING, ids, run
from worker.speculative.adaptive import MAX_REST, MIN_GAIN, Pace, Speculation, Track
from worker.speculative.cost import ENOUGH, WINDOW, StepCost


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps(cost: StepCost, clock: Clock, kinds, plain: float, verify: float,
          rows: int = 1) -> None:
    """Steps of these kinds ("p", "v"), timed as a pipelined batch runs them, a verify
    step costing `verify` where a plain one costs `plain`: the verify step waits for the
    plain step in flight (most of a step) and leaves nothing in flight, so the plain step
    after it takes a tenth of a step and the one after that a whole one."""
    previous = "p"
    for kind in kinds:
        if kind == "v":
            clock.now += verify + (0.9 * plain if previous == "p" else 0.0)
        else:
            clock.now += 0.1 * plain if previous == "v" else plain
        cost.stepped(rows, kind == "v")
        previous = kind


def test_a_verify_step_is_priced_against_the_plain_step_it_replaces():
    clock = Clock()
    cost = StepCost(MIN_GAIN, clock)
    steps(cost, clock, "pvpvp", 0.010, 0.030)
    assert cost.extra(1) == MIN_GAIN  # (the prior: nothing measured yet)
    steps(cost, clock, "vpvvp" * ENOUGH, 0.010, 0.030)
    assert cost.wants_plain(1) and not cost.wants_plain(2)  # (verify steps, too few plain)
    assert cost.extra(1) == MIN_GAIN
    steps(cost, clock, "p" * (ENOUGH + 1), 0.010, 0.030)
    assert not cost.wants_plain(1)
    assert cost.extra(1) == pytest.approx(2.0)        # 3 steps' time for one
    assert cost.extra(2) == MIN_GAIN                  # another batch size: not yet
    assert cost.must_earn(1, 1) == pytest.approx(2.0)
    steps(cost, clock, "vpp" * WINDOW, 0.010, 0.011)   # (the latest WINDOW count)
    assert cost.extra(1) == pytest.approx(0.1)


def test_a_prefill_chunk_or_another_batch_size_is_no_sample():
    clock = Clock()
    cost = StepCost(MIN_GAIN, clock)
    for _ in range(3 * ENOUGH):
        clock.now += 0.010
        cost.stepped(1, False)
        clock.now += 1.0
        cost.stepped(1, None)      # (a prefill chunk: a second)
        clock.now += 0.030
        cost.stepped(2, True)      # (another row joined)
    assert not cost.verify and all(max(s) == pytest.approx(0.010) for s in cost.plain.values())
    # (a vision batch's image prefill before its step: Speculation.untimed)
    spec = Speculation(cost=StepCost(MIN_GAIN, clock))
    for untimed in (True, False, True, False):
        clock.now += 1.0 if untimed else 0.010
        spec.step, spec.untimed = (1, False), untimed
        spec.timed(False)
    assert not spec.cost.plain


def test_a_draft_models_passes_are_not_the_verify_steps_cost():
    """A draft model's passes in a verify step have their own price (`Pace.cost`): the
    verify step is timed without them."""
    clock = Clock()
    cost = StepCost(MIN_GAIN, clock)
    for _ in range(ENOUGH + 1):
        clock.now += 0.010
        with cost.drafting():
            clock.now += 0.050
        clock.now += 0.020
        cost.stepped(1, True)
    steps(cost, clock, "p" * (ENOUGH + 2), 0.010, 0.0)
    assert cost.extra(1) == pytest.approx(2.0)


def pace_after(verify: float, steps: int = 300, accepted: int = 1):
    """A speculating sequence's Pace, and how many times it drafted, alone in a batch,
    driven as verify.py's step drives a Speculation: a drafter with a guess at every step,
    drafts keeping `accepted` tokens each, a verify step costing `verify` plain steps."""
    clock = Clock()
    spec = Speculation(cost=StepCost(MIN_GAIN, clock))

    class Drafter:
        def extend(self, tokens):
            pass

        def ready(self):
            return True

        def propose(self, k):
            return [1] * k

    spec.add(1, Track(Drafter(), Pace(8), seq=None))
    drafted, previous = 0, "p"
    for _ in range(steps):
        draft = spec.propose(1, 0, 100) if spec.wants([1]) else []
        if draft:
            spec.verifying(1, 1)
            spec.verified(1, draft, accepted, [0] * (1 + accepted), 0)
            drafted += 1
            clock.now += verify + (0.9 if previous == "p" else 0.0)
        else:
            spec.reported([Response(1, 0)])
            clock.now += 0.1 if previous == "v" else 1.0
        spec.step = (1, bool(draft))
        spec.timed(False)
        previous = "v" if draft else "p"
    return spec.tracks[1].pace, drafted


class Response:
    def __init__(self, uid, token):
        self.uid, self.token = uid, token


def test_one_token_per_verification_rests_where_verify_costs_three_steps():
    dear, dear_drafts = pace_after(3.0)
    cheap, cheap_drafts = pace_after(1.1)
    assert cheap_drafts > 300 - 2 * ENOUGH     # drafting at every step but the timed ones
    # Under the prior until timed (ENOUGH verify steps), then resting, doubling its rest
    # (4, 8, ... 64 steps), and probing again after each: about 7 probes in 270 steps.
    assert ENOUGH + 5 <= dear_drafts <= ENOUGH + 12
    assert dear.backoff > 4 and cheap.backoff == 4


def test_in_a_batch_of_n_a_sequence_rests_up_to_n_times_longer():
    """Each sequence that wakes to probe makes the whole batch verify: in a batch of 8,
    one that keeps failing rests up to 8 x MAX_REST steps."""
    alone, in_eight = Pace(8), Pace(8)
    for _ in range(12):
        alone.update(4, 0, 1.0, rows=1)
        in_eight.update(4, 0, 1.0, rows=8)
    assert (alone.rest, in_eight.rest) == (MAX_REST, 8 * MAX_REST)


def test_in_a_batch_the_rows_drafting_pay_for_every_row():
    clock = Clock()
    cost = StepCost(MIN_GAIN, clock)
    assert cost.must_earn(8, 1) == MIN_GAIN  # (the prior, per row: until measured)
    steps(cost, clock, "vpp" * (ENOUGH + 1), 0.010, 0.015, rows=8)
    assert cost.must_earn(8, 8) == pytest.approx(0.5)
    assert cost.must_earn(8, 2) == pytest.approx(2.0)
    assert cost.must_earn(5, 2) == pytest.approx(5 * 0.5 / 2)  # (5-8 rows: one bucket)


def test_the_batch_times_its_steps_and_a_dear_verify_leaves_the_text_alone(
        engine, monkeypatch):
    """The real batch on the tiny model: its steps are timed (plain and verify samples),
    and where every verify step is made to cost 20 plain steps (more than the 8 tokens a
    whole draft brings), prompt lookup drafts less than where it costs one, the text the
    same."""
    import tests.worker.test_speculative as ts

    req = {"p": dict(prompt=REPEATING, max_tokens=200, temperature=0.0)}
    without, _, _ = run(engine, req)
    counts, costs = {}, {}
    for verify in (1.0, 20.0):
        clock = Clock()

        class Priced(StepCost):
            """A step takes 10 ms by the test's clock, a verify step `verify` times
            that: the price is the test's, its use the batch's."""

            def stepped(self, rows, verified, verify=verify):
                clock.now += 0.010 * (verify if verified else 1.0)
                super().stepped(rows, verified)

        def make(engine, make_batch=ts.make_batch, **kw):
            b = make_batch(engine, **kw)
            b.speculation.cost = costs[verify] = Priced(MIN_GAIN, clock)
            return b

        monkeypatch.setattr(ts, "make_batch", make)
        got, _, _ = run(engine, req, speculative="prompt-lookup")
        monkeypatch.undo()
        assert ids(got["p"]) == ids(without["p"])
        counts[verify] = run.totals.verifications
    assert costs[1.0].plain.get(1) and costs[1.0].verify.get(1)
    assert costs[20.0].extra(1) > 8 and costs[1.0].extra(1) < MIN_GAIN
    assert counts[20.0] < counts[1.0]
