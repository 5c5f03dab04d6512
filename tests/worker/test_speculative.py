"""Speculative decoding inside the batch (worker/speculative/) on the tiny float32 model:
drafts verified in one batched step change nothing in the output (temperature 0 equals
decoding without them, alone and beside sequences that do not speculate; a seed
reproduces), and a rejected draft leaves nothing in the KV cache."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from worker.speculative.drafters import Prediction, PromptLookup
from worker.speculative.verify import _keep_only

REPEATING = "word one two three " * 10


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = PromptLookup([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8])
    d.extend([1, 2])
    assert d.propose(3) == [3, 7, 8]  # after the latest "1 2", not the first
    d.extend([3, 7, 8])
    assert d.propose(2) == [1, 2]     # the output itself is looked up too
    assert PromptLookup([5, 6]).propose(4) == []


def test_prediction_follows_the_client_text_and_finds_its_place_again():
    d = Prediction([10, 11, 12, 13, 14, 15, 16])
    assert d.propose(3) == [10, 11, 12]
    d.extend([10, 11, 99])             # departs
    assert d.propose(2) == []
    d.extend([13, 14])                 # back on the text
    assert d.propose(3) == [15, 16]


def test_a_resting_prediction_drafts_again_once_the_output_is_back_on_it():
    """A prediction's rest ends when the output agrees with it again by a whole n-gram
    (its departures are edits, its drafts cost nothing to make); prompt lookup rests on."""
    from worker.speculative.adaptive import RESYNC, Pace, Track

    text = list(range(10, 40))
    pred = Track(Prediction(text), Pace(8), seq=None, prediction=True)
    look = Track(PromptLookup(text), Pace(8), seq=None)
    for t in (pred, look):
        t.pace.rest = 16                 # (drafts failed: resting)
        t.drafter.extend([10, 11, 99])   # the output departs
    assert not pred.wants() and not look.wants()
    pred.drafter.extend([13])            # one token found again: not yet
    assert not pred.wants()
    for t in (pred, look):
        t.drafter.extend(list(range(14, 14 + RESYNC)))
    assert pred.wants() and pred.drafter.propose(2) == [17, 18]
    assert not look.wants() and look.pace.rest == 16


def test_a_rejected_suffix_leaves_no_trace_in_a_batch_cache():
    c = BatchKVCache([0, 0])
    keys = mx.arange(2 * 6, dtype=mx.float32).reshape(2, 1, 6, 1)
    c.update_and_fetch(keys, keys)
    _keep_only([c], [1, 3])            # row 0 keeps 5 positions, row 1 keeps 3
    assert c.extract(0).keys.reshape(-1).tolist() == [0, 1, 2, 3, 4]
    assert c.extract(1).keys.reshape(-1).tolist() == [6, 7, 8]


def run(engine, requests: dict, predicted: dict | None = None, **batch):
    """{name: outcomes}, {name: Seq} and the number of steps, for requests run together;
    the batch's speculation totals in `run.totals`."""
    b = make_batch(engine, **batch)
    seqs, out = {}, {}
    for name, kw in requests.items():
        prep = engine.prepare(generate(rid=name, **kw))
        if predicted and name in predicted:
            prep.prediction = predicted[name]
        seqs[name], out[name] = Seq(name), []
        b.add(seqs[name], prep)
    n = 0
    while b.members:
        n += 1
        for seq, o in b.step():
            assert not isinstance(o, Exception), o
            out[seq.rid].append(o)
    run.totals = b.speculation and b.speculation.totals
    return out, seqs, n


def ids(outcomes) -> list[int]:
    return [o[0] for o in outcomes if o[0] >= 0]


def text(outcomes) -> str:
    return "".join(o[1] for o in outcomes)


FOUR = {
    # (the tiny model falls into a loop after 40 tokens: lookup's drafts accepted)
    "lookup": dict(prompt=REPEATING, max_tokens=80, temperature=0.0),
    "plain": dict(prompt="Hi there", max_tokens=30, temperature=0.0),
    "biased": dict(prompt=REPEATING, max_tokens=30, temperature=0.0,
                   logit_bias=[(5, 2.0)]),   # a logits processor: never speculates
    "predicted": dict(prompt="The quick brown fox " * 5, max_tokens=35, temperature=0.0),
}


def test_greedy_text_is_identical_with_drafts_alone_and_in_a_batch_of_four(engine):
    without, _, _ = run(engine, FOUR)
    exact = ids(without["predicted"])
    wrong = exact[:10] + [5, 6] + exact[12:]        # a prediction that departs once
    for predicted in (exact, wrong):
        with_, seqs, _ = run(engine, FOUR, {"predicted": predicted},
                             speculative="prompt-lookup")
        for name in FOUR:
            assert ids(with_[name]) == ids(without[name]), name
            assert text(with_[name]) == text(without[name]), name
        assert seqs["predicted"].draft_accepted >= 20
        pred = seqs["predicted"]
        assert run.totals.drafted > pred.draft_accepted + pred.draft_rejected  # lookup drafted
        assert not hasattr(seqs["lookup"], "draft_accepted")  # (prediction counts only)
        assert not hasattr(seqs["biased"], "draft_accepted")
    alone, _, plain_steps = run(engine, {"predicted": FOUR["predicted"]})
    fast, seqs, steps = run(engine, {"predicted": FOUR["predicted"]}, {"predicted": exact})
    assert ids(fast["predicted"]) == ids(alone["predicted"])
    # Each step reports its pending token and the drafts after it: 35 tokens in 5 steps
    # (drafts of 4, 8, 8, 8, then the 2 the budget leaves), every draft accepted.
    assert (seqs["predicted"].draft_accepted, seqs["predicted"].draft_rejected) == (30, 0)
    assert steps < plain_steps / 3


def test_a_seeded_sampled_request_gives_the_same_text_twice(engine):
    req = {"s": dict(prompt=REPEATING, max_tokens=40, temperature=0.9, seed=7)}
    plain, _, _ = run(engine, req)
    guess = {"s": ids(plain["s"])}  # (drafts that are sometimes right)
    first, seqs, _ = run(engine, req, guess, speculative="prompt-lookup")
    second, _, _ = run(engine, req, guess, speculative="prompt-lookup")
    assert ids(first["s"]) == ids(second["s"])
    assert run.totals.drafted > 0


def test_a_stop_string_inside_an_accepted_draft_ends_the_text_there(engine):
    plain = {"p": dict(prompt="The quick brown fox " * 5, max_tokens=35, temperature=0.0)}
    without, _, _ = run(engine, plain)
    exact = ids(without["p"])
    stop = engine.tokenizer.decode(exact[12:14])
    req = {"p": dict(plain["p"], stop=[stop])}
    want, _, _ = run(engine, req)
    got, seqs, _ = run(engine, req, {"p": exact})
    assert text(got["p"]) == text(want["p"]) and got["p"][-1][2] == want["p"][-1][2] == "stop"
    assert seqs["p"].draft_accepted > 0


def test_a_step_without_drafts_is_mlx_lms_own_and_the_drafter_follows_the_text(
        engine, monkeypatch):
    """A drafter with no guess keeps mlx-lm's pipelined step (no verification); one
    whose guess vanishes once the pending token is known falls back to it too, and
    either way the drafter holds exactly the prompt and the output, once each."""
    from worker.speculative import verify
    verified = []
    real = verify.verify
    monkeypatch.setattr(verify, "verify", lambda gb, spec: verified.append(
        r := real(gb, spec)) or r)
    req = {"p": dict(prompt=REPEATING, max_tokens=30, temperature=0.0)}
    without, _, _ = run(engine, req)
    drafters = []
    init = PromptLookup.__init__
    monkeypatch.setattr(PromptLookup, "__init__",
                        lambda self, prompt: drafters.append(self) or init(self, prompt))
    for ready in (False, True):
        monkeypatch.setattr(PromptLookup, "ready", lambda self: ready)
        monkeypatch.setattr(PromptLookup, "propose", lambda self, k: [])
        verified.clear()
        got, _, _ = run(engine, req, speculative="prompt-lookup")
        assert ids(got["p"]) == ids(without["p"])
        assert run.totals.verifications == 0
        assert all(r is None for r in verified)  # (each fell back to mlx-lm's step)
        assert bool(verified) == ready  # (a few: finding nothing, the sequence rests)
        d = drafters.pop()
        prompt = list(engine.prepare(generate(rid="p", **req["p"])).ids)
        assert d._index.tokens + d._pending == prompt + ids(got["p"])


def test_cancelling_a_sequence_mid_draft_leaves_the_others_and_the_next_untouched(engine):
    reqs = {"predicted": FOUR["predicted"], "plain": FOUR["plain"]}
    alone = {name: run(engine, {name: kw})[0][name] for name, kw in reqs.items()}
    b = make_batch(engine, speculative="prompt-lookup")
    seqs, out = {}, {n: [] for n in reqs}
    for name, kw in reqs.items():
        prep = engine.prepare(generate(rid=name, **kw))
        if name == "predicted":
            prep.prediction = ids(alone["predicted"])
        seqs[name] = Seq(name)
        b.add(seqs[name], prep)
    while not getattr(seqs["predicted"], "draft_accepted", 0):  # (a draft verified)
        for seq, o in b.step():
            out[seq.rid].append(o)
    uid = seqs["predicted"].uid
    b.remove(seqs["predicted"])
    assert uid not in b.speculation.tracks
    later = engine.prepare(generate(rid="later", **FOUR["predicted"]))
    later.prediction = ids(alone["predicted"])
    b.add(Seq("later"), later)
    out["later"] = []
    while b.members:
        for seq, o in b.step():
            out[seq.rid].append(o)
    assert text(out["plain"]) == text(alone["plain"])
    assert text(out["later"]) == text(alone["predicted"])
