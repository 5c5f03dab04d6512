"""A batch of several rows verifies only while its rows' drafts pay for the step together
(worker/speculative/adaptive.py `Gate`): a verification holds every row of the batch, so
in a batch of n rows it costs n x what it costs one, and rows whose drafts earn little
rest together instead of each costing the batch a probe of its own."""

from __future__ import annotations

from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from tests.worker.test_speculative import ids
from worker.speculative.adaptive import MAX_REST, RESYNC, Gate, Pace, Speculation, Track
from worker.speculative.drafters import Prediction


def test_a_gate_rests_the_batch_while_its_steps_earn_less_than_they_cost():
    g = Gate()
    g.update(earned=8, cost=4.0)            # paid twice over
    assert g.rest == 0
    g.update(earned=0, cost=4.0)            # gain (1.5 + 0) / 2 = 0.75: rests
    assert g.rest == 4 and g.backoff == 8
    for _ in range(4):
        g.plain_step()
    assert g.rest == 0
    g.update(earned=1, cost=4.0)            # the probe: still short, rests twice as long
    assert g.rest == 8 and g.backoff == 16
    for _ in range(8):
        g.plain_step()
        g.update(earned=0, cost=4.0)        # (each probe after a rest fails again)
        g.rest = 0
    assert g.backoff == MAX_REST
    g.update(earned=9, cost=4.0)            # a step that pays: the next rest is short
    assert g.rest == 0 and g.backoff == 4


class Guess:
    """A drafter that always has a guess: `token` k times."""

    def __init__(self, token: int = 3):
        self.token, self.synced = token, 0

    def ready(self) -> bool:
        return True

    def extend(self, tokens) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return [self.token] * k


class Sampling:
    def __init__(self, seed=None, temperature=0.7):
        self.seed, self.temperature = seed, temperature


def test_a_resting_batch_drafts_only_for_rows_bound_to_their_own_pace():
    spec = Speculation()
    spec.gate.rest = 5
    spec.add(1, Track(Guess(), Pace(4), seq=None))
    spec.add(2, Track(Guess(), Pace(4), seq=None, sampling=Sampling(seed=None)))
    assert spec.tracks[1].pace.wants() and spec.tracks[2].pace.wants()
    assert not spec.wants([1, 2])                 # the batch rests: a plain step
    assert spec.wants([1])                        # a batch of one: its own pace
    assert spec.propose_all([1, 2], [7, 7], [9, 9]) == [[], []]
    # A seeded sampled row's text depends on which steps it drafts at: it keeps its
    # pace, so its seed gives the same text alone and in any batch.
    spec.add(3, Track(Guess(), Pace(4), seq=None, sampling=Sampling(seed=11)))
    assert spec.tracks[3].bound and not spec.tracks[2].bound
    assert spec.wants([1, 3])
    assert spec.propose_all([1, 3], [7, 7], [9, 9]) == [[], [3, 3, 3, 3]]
    # A prediction back on the client's text ends the batch's rest.
    pred = Prediction(list(range(10, 40)))
    spec.add(4, Track(pred, Pace(4), seq=None, prediction=True))
    pred.extend([10, 11, 99])
    assert not spec.wants([1, 4])
    pred.extend(list(range(13, 13 + RESYNC)))
    assert spec.wants([1, 4])
    # The rest is counted in plain steps.
    spec.reported([], fed=True)
    assert spec.gate.rest == 4


def test_a_verification_costs_the_batch_n_times_the_price_of_its_longest_draft():
    spec = Speculation()
    got = []
    spec.gate.update = lambda earned, cost: got.append((earned, cost))
    for uid in (1, 2, 3):
        spec.add(uid, Track(Guess(), Pace(8, verify=(0.5, 1.2)), seq=None))
    spec.batch_verified([1, 2, 3, 4], [[5], [], [5] * 8, []], earned=6)
    assert got == [(6, 4 * 1.2)]
    spec.batch_verified([1], [[5]], earned=1)        # one row: its Pace's business
    spec.batch_verified([1, 2], [[], []], earned=0)  # nothing drafted
    assert len(got) == 1


def _verify_steps(engine, monkeypatch, gate: bool, tokens: int = 60):
    """Four rows whose drafts are never kept (a drafter that always guesses one token),
    joining at different steps: (their texts, the batch's verify steps)."""
    if not gate:
        monkeypatch.setattr(Speculation, "batch_verified", lambda *a, **k: None)
    b = make_batch(engine, speculative="prompt-lookup")
    steps = [0]
    stepped = b.speculation.stepped
    b.speculation.stepped = lambda: (steps.__setitem__(0, steps[0] + 1), stepped())[1]
    out, n = {}, 0
    names = ["a", "b", "c", "d"]
    while b.members or names:
        if names and n % 5 == 0:                     # (a new row every 5 steps)
            name = names.pop(0)
            b.add(Seq(name), engine.prepare(generate(
                rid=name, prompt=f"{name} is for", max_tokens=tokens, temperature=0.0)))
            out[name] = []
            for t in b.speculation.tracks.values():
                t.drafter = Guess(token=engine.vocab_size - 1)
        n += 1
        for seq, o in b.step():
            out[seq.rid].append(o)
    monkeypatch.undo()
    return {k: ids(v) for k, v in out.items()}, steps[0], b.speculation.totals


def test_rows_whose_drafts_earn_nothing_rest_together(engine, monkeypatch):
    """Without the gate each row's rest ends on its own and each probe costs the whole
    batch a verification; with it the batch rests and probes once for all."""
    gated, gated_steps, totals = _verify_steps(engine, monkeypatch, gate=True)
    alone, alone_steps, _ = _verify_steps(engine, monkeypatch, gate=False)
    assert gated == alone and all(len(v) == 60 for v in gated.values())  # same text
    assert totals.drafted > totals.accepted      # (it drafted, and was refused)
    assert gated_steps < alone_steps * 0.75, (gated_steps, alone_steps)


def test_a_batch_whose_drafts_pay_keeps_verifying(engine):
    """The tiny model loops after ~40 tokens of this prompt; four such rows' drafts pay
    for the batch's steps (the price of one row, x4) and the gate stays open."""
    from tests.worker.test_speculative import REPEATING
    b = make_batch(engine, speculative="prompt-lookup")
    for name in "abcd":
        b.add(Seq(name), engine.prepare(generate(rid=name, prompt=REPEATING,
                                                 max_tokens=120, temperature=0.0)))
    while b.members:
        b.step()
    t = b.speculation.totals
    assert t.accepted >= 4 * 40 and b.speculation.gate.backoff == 4, t
