"""A draft model (worker/speculative/draft_model.py) inside the batch, on tiny float32
random models: the target drafting for itself (every draft accepted: an honest check that
the draft cache follows the target's text exactly) and another random model with the same
tokenizer (most drafts rejected: its cache must drop them). Either way the text at
temperature 0 is the one decoding gives without a draft, alone and in a batch of four
beside sequences that do not draft; a seed reproduces; rows leave the draft's batch with
their sequences."""

from __future__ import annotations

import argparse

import pytest

from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from tests.worker.test_speculative import FOUR, REPEATING, ids, run, text
from worker.errors import LoadError
from worker.loading.draft import load_draft
from worker.loop.sizing import KVSize
from worker.speculative.adaptive import Pace
from worker.speculative.draft_model import DraftModel


@pytest.fixture(scope="module")
def other_model(models_dir):
    """A second random model of the tiny preset (another seed): the same tokenizer."""
    from mlx_lm import load

    from worker.demos.text import build_model

    return load(str(build_model(models_dir / "tiny-seed1", "tiny", seed=1).path))[0]


def test_the_target_drafting_for_itself_has_every_draft_accepted(engine):
    req = {"p": dict(prompt="Hi there", max_tokens=40, temperature=0.0)}
    without, _, plain_steps = run(engine, req)
    with_, _, steps = run(engine, req, draft=DraftModel(engine.model, 64))
    assert text(with_["p"]) == text(without["p"])
    t = run.totals
    assert t.drafted > 30 and t.accepted == t.drafted
    assert steps < plain_steps / 3


def test_the_next_turn_prefills_only_what_is_new_in_the_draft_model(engine):
    """The draft model's prompt cache: the next turn (the last prompt, its answer, a new
    question) starts its draft row from the last prompt's state and prefills the rest;
    from that state the target drafting for itself still has every draft accepted (a
    wrong state would not be), and the text is decoding's own."""
    from worker.kvcache.prefix import PrefixCache

    class Counting:  # the draft model, counting the positions each call reads
        def __init__(self, model):
            self.model, self.read = model, []

        def __call__(self, inputs, cache=None):
            self.read.append(inputs.shape[1])
            return self.model(inputs, cache=cache)

        def __getattr__(self, name):  # (its layers, for its caches)
            return getattr(self.model, name)

    draft = Counting(engine.model)
    group = DraftModel(draft, 64, prefix=PrefixCache(1 << 26))
    first = dict(prompt="Hello there, my friend " * 6, max_tokens=12, temperature=0.0)
    prep1 = engine.prepare(generate(**first))
    said, _, _ = run(engine, {"t1": first}, draft=group)
    ids2 = list(prep1.ids) + ids(said["t1"]) + [5, 6, 7, 8]
    from protocol.messages import pack_ids

    draft.read.clear()
    req = {"t2": dict(prompt_ids=pack_ids(ids2), max_tokens=16, temperature=0.0)}
    with_, _, _ = run(engine, req, draft=group)
    t = run.totals
    assert draft.read[0] == len(ids2) - 1 - (len(prep1.ids) - 1)  # (its prefill: the new)
    assert group.prefix.hits == 1 and t.drafted > 8 and t.accepted == t.drafted
    assert text(with_["t2"]) == text(run(engine, req)[0]["t2"])


def test_greedy_text_is_identical_with_a_draft_model_alone_and_in_a_batch_of_four(
        engine, other_model):
    without, _, _ = run(engine, FOUR)
    exact = ids(without["predicted"])
    for draft in (engine.model, other_model):
        group = DraftModel(draft, 64)
        with_, seqs, _ = run(engine, FOUR, {"predicted": exact}, draft=group)
        for name in FOUR:
            assert ids(with_[name]) == ids(without[name]), name
        t, pred = run.totals, seqs["predicted"]
        by_model = t.drafted - pred.draft_accepted - pred.draft_rejected
        if draft is engine.model:  # (the prediction's drafts: all accepted too)
            assert by_model > 60 and t.accepted == t.drafted
        else:                      # (another model: rejected, until its rows rest)
            assert by_model > 8 and t.accepted - pred.draft_accepted < by_model
        assert not group.rows and not group.batch.order and not group.batch.cache  # (all left)
    alone, _, _ = run(engine, {"plain": FOUR["plain"]}, draft=DraftModel(other_model, 64))
    assert ids(alone["plain"]) == ids(without["plain"])


def test_a_seeded_sampled_request_with_a_draft_model_gives_the_same_text_twice(engine):
    req = {"s": dict(prompt=REPEATING, max_tokens=40, temperature=0.9, seed=7)}
    first, _, _ = run(engine, req, draft=DraftModel(engine.model, 64))
    assert run.totals.accepted > 0
    second, _, _ = run(engine, req, draft=DraftModel(engine.model, 64))
    assert ids(first["s"]) == ids(second["s"])


def test_the_draft_cache_holds_exactly_each_rows_text_after_drafts_were_rejected(
        engine, other_model):
    """After steps whose drafts were cut short, each row of the draft's batch cache is
    the draft model's own cache of that sequence's text (prompt and output) so far,
    nothing rejected left in it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    group = DraftModel(other_model, 64)
    b = make_batch(engine, draft=group)
    seqs, out = {}, {}
    for name in ("a", "b"):
        prep = engine.prepare(generate(rid=name, prompt=REPEATING[: 20 + 30 * (name == "b")],
                                       max_tokens=40, temperature=0.0))
        seqs[name], out[name] = Seq(name), list(prep.ids)
        b.add(seqs[name], prep)
    for _ in range(8):
        for seq, o in b.step():
            if o[0] >= 0:
                out[seq.rid].append(o[0])
    assert b.speculation.totals.accepted < b.speculation.totals.drafted  # (rejections)
    for name, seq in seqs.items():
        row = group.rows[seq.uid]
        row.settle()
        i = group.batch.order.index(seq.uid)
        held = [c.extract(i) for c in group.batch.cache]
        want = make_prompt_cache(other_model)
        read = out[name][: len(out[name]) - len(row.backlog)]  # (not yet: its backlog)
        assert held[0].offset == len(read) > len(out[name]) - 10
        other_model(mx.array([read]), cache=want)
        for h, w in zip(held, want):
            assert mx.allclose(h.keys, w.keys[..., : w.offset, :], atol=1e-4)


def test_a_draft_model_loads_only_where_it_can_work(engine, tiny_model, models_dir,
                                                    monkeypatch):
    from worker.loading import draft

    args = argparse.Namespace(max_draft_tokens=8, kv_bits=None, max_kv_size=None,
                              prefill_step=64)
    monkeypatch.setattr(draft, "step_cost", lambda d, t: 0.3)  # (a pass: 0.3 of a step)
    loaded = load_draft(str(tiny_model), args, engine)
    assert isinstance(loaded, DraftModel) and loaded.cost == 0.3 and loaded.prefix is None
    # With a prompt cache, the draft has its own, as many tokens (the same model here).
    cached = load_draft(str(tiny_model), argparse.Namespace(
        **{**vars(args), "prompt_cache_bytes": 1 << 20}), engine)
    assert cached.prefix.max_bytes == 1 << 20
    for cost in (1.1, 0.87, 0.81):  # (cannot pay: off; 0.87 the 4-bit demo on an H200)
        monkeypatch.setattr(draft, "step_cost", lambda d, t: cost)
        assert load_draft(str(tiny_model), args, engine) is None
    # A pass of 0.6 steps pays at a verify step priced as one plain step; not where the
    # device prices a verification at 0.9 tokens over one (a lent H200's, in place).
    monkeypatch.setattr(draft, "step_cost", lambda d, t: 0.6)
    assert isinstance(load_draft(str(tiny_model), args, engine), DraftModel)
    assert load_draft(str(tiny_model), args, engine, verify=(0.9, 0.9)) is None
    assert load_draft("", args, engine) is None
    assert load_draft(str(tiny_model), args, engine, "vision") is None
    with pytest.raises(LoadError, match="--max-kv-size"):
        load_draft(str(tiny_model), argparse.Namespace(**{**vars(args), "max_kv_size": 64}),
                   engine)
    # Under --kv-bits (0: full precision, a model's own kv_bits=0 under a server-wide
    # one) the draft keeps its cache at full precision; its prompt cache holds as many
    # tokens as the model's, whose bytes per token are the quantized ones.
    monkeypatch.setattr(draft, "step_cost", lambda d, t: 0.3)
    for bits in (0, 8):
        on = argparse.Namespace(**{**vars(args), "kv_bits": bits, "prompt_cache_bytes": 1 << 20})
        assert load_draft(str(tiny_model), on, engine).prefix.max_bytes == 1 << 20
    quarter = load_draft(str(tiny_model), on, engine,
                         target_per_token=KVSize.measure(engine.model).per_token / 4)
    assert quarter.prefix.max_bytes == 4 << 20
    from worker.demos.text import build_model
    other = build_model(models_dir / "tiny-other-vocab", "tiny",  # (more merges learnt)
                        corpus=("a quokka and a zebra",) * 50).path
    with pytest.raises(LoadError, match="another vocabulary"):
        load_draft(str(other), args, engine)


def test_a_draft_model_loads_where_some_draft_length_beats_a_plain_step():
    """The break-even rule: k passes of cost c and a verify step of v bring
    (1 - a^(k+1)) / (1 - a) tokens at acceptance a; a draft loads where some k beats one
    token per step, at a generous a (0.8)."""
    from worker.speculative.cost import best_draft

    assert best_draft(0.87) == (0, 1.0)               # the 4-bit demo on an H200: off
    assert best_draft(0.79)[0] == 1                   # 1.8 tokens for 1.79 steps
    assert best_draft(0.75, verify=1.2)[0] == 0       # (a dearer verify step: off)
    assert best_draft(0.5)[0] == 2 and best_draft(0.5, verify=lambda k: 1 + 0.1 * k)[0] == 1
    k, rate = best_draft(0.1)                         # a much smaller model
    assert k == 6 and rate == pytest.approx(2.47, abs=0.01)
    assert best_draft(0.0, longest=3) == (3, pytest.approx(1 + 0.8 + 0.64 + 0.512))
    assert best_draft(0.5, acceptance=0.3) == (0, 1.0)


def test_a_draft_that_costs_what_it_earns_rests():
    """A draft model's passes are priced in target steps (`DraftModel.cost`, measured at
    load): eight tokens drafted and all accepted pay where a pass is cheap, and not
    where a pass costs a whole target step (a quantized copy on MLX's CPU backend)."""
    cheap, dear = Pace(8, cost=0.1), Pace(8, cost=1.0)
    for pace in (cheap, dear):
        pace.update(8, 8)
    assert cheap.wants() and not dear.wants()
