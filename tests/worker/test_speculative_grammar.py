"""A grammar's sequence drafts (worker/speculative/grammar.py), on the tiny float32 model:
the tokens a schema forces are drafted and kept, a guess the grammar forbids is cut before
the step, a rejected one is given back to the grammar, and the text is decoding's own."""

from __future__ import annotations

import json

import pytest

from tests.generates import generate
from tests.worker.test_speculative import FOUR, ids, run, text
from tests.worker.test_speculative_mtp import mtp  # noqa: F401
from worker.speculative.grammar import GrammarDraft
from worker.text.decoding import GrammarMask

# Long keys: most of the output is text the schema fixes.
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"description_of_item": {"type": "string", "maxLength": 12},
                         "is_available_now": {"type": "boolean"},
                         "number_of_units": {"type": "integer", "maximum": 999}},
          "required": ["description_of_item", "is_available_now", "number_of_units"]}


def json_request(**kw) -> dict:
    return dict(messages=[{"role": "user", "content": "JSON please"}],
                max_tokens=kw.pop("max_tokens", 80), temperature=kw.pop("temperature", 0.0),
                response_format="json_schema", json_schema=SCHEMA, **kw)


def test_a_schemas_fixed_text_is_drafted_and_the_text_is_decodings_own(engine):
    req = {"json": json_request()}
    plain, _, plain_steps = run(engine, req, max_draft=0)  # (no speculation at all)
    got, seqs, steps = run(engine, req)
    out = text(plain["json"])
    assert text(got["json"]) == out and ids(got["json"]) == ids(plain["json"])
    assert got["json"][-1][2] == plain["json"][-1][2] == "stop"
    assert set(json.loads(out)) == set(SCHEMA["required"])
    # The keys, quotes, colons and commas the schema fixes were drafted and kept: the
    # three keys alone are more than 15 tokens.
    assert run.totals.accepted >= 15 and run.totals.verifications >= 3
    assert steps <= plain_steps - 15
    assert not hasattr(seqs["json"], "draft_accepted")  # (no prediction: nothing to count)


def test_beside_drafting_sequences_each_text_is_its_own(engine):
    reqs = dict(FOUR, json=json_request())
    alone = {name: run(engine, {name: kw}, max_draft=0)[0][name] for name, kw in reqs.items()}
    predicted = {"predicted": ids(alone["predicted"])}
    got, seqs, _ = run(engine, reqs, predicted, speculative="prompt-lookup")
    for name in reqs:
        assert ids(got[name]) == ids(alone[name]), name
        assert text(got[name]) == text(alone[name]), name
    assert seqs["predicted"].draft_accepted > 0


def _edited(engine, tokens: list[int], after: str, new: str) -> list[int]:
    """`tokens`' text with what follows `after` starting with `new` instead, tokenized."""
    s = engine.tokenizer.decode(tokens)
    at = s.index(after) + len(after)
    return engine.tokenizer.encode(s[:at] + new + s[at + len(new):], add_special_tokens=False)


def test_a_prediction_the_grammar_forbids_is_cut_and_one_the_model_rejects_given_back(
        engine, monkeypatch):
    """A prediction with a key the schema does not have: its tokens there are never fed to
    the grammar (that would be the request's error); one with another string value: the
    grammar allows it, the model does not take it, and the grammar gives it back."""
    req = {"json": json_request()}
    plain, _, _ = run(engine, req, max_draft=0)
    exact = ids(plain["json"])
    proposed = []
    real = GrammarDraft.valid
    monkeypatch.setattr(GrammarDraft, "valid", lambda self, p, d: proposed.append(
        (d, r := real(self, p, d))) or r)
    out = text(plain["json"])
    start = out.index('"description_of_item": "') + len('"description_of_item": "')
    upto = [len(engine.tokenizer.decode(exact[:k])) for k in range(len(exact) + 1)]
    k = next(k for k, n in enumerate(upto) if n > start + 1) + 1  # (inside the value)
    assert upto[k + 3] < out.index('"', start)
    forbidden = _edited(engine, exact, '"number_of_', "parts")
    z = engine.tokenizer.encode("z", add_special_tokens=False)
    rejected = exact[:k] + z * 3 + exact[k + 3:]  # (the model's start, then not its text)
    for guess in (forbidden, rejected):
        proposed.clear()
        got, seqs, _ = run(engine, req, {"json": guess})
        assert text(got["json"]) == out
        assert seqs["json"].draft_accepted > 0
        edited = set(guess) - set(exact)
        cut = [d for d, kept in proposed if set(d[len(kept):]) & edited]
        assert (seqs["json"].draft_rejected > 0) == (guess is rejected)
        assert bool(cut) == (guess is forbidden)  # (never fed to the grammar)


def test_a_seeded_sampled_request_gives_the_same_valid_json_twice(engine):
    req = {"s": json_request(temperature=0.9, seed=11)}
    first, _, _ = run(engine, req)
    drafted = run.totals.accepted
    second, _, _ = run(engine, req)
    assert ids(first["s"]) == ids(second["s"]) and drafted > 0
    assert first["s"][-1][2] == "stop"
    assert set(json.loads(text(first["s"]))) == set(SCHEMA["required"])


@pytest.fixture
def grammar(engine):
    """(the GrammarDraft of a fresh schema request, as a sequence's first decode step
    finds it: its prompt went by, nothing generated yet; the token ids of the text)."""
    prep = engine.prepare(generate(rid="g", **json_request()))
    mask = GrammarMask(prep.constraint, engine.eos)
    mask.primed = True
    return GrammarDraft(mask), lambda s: engine.tokenizer.encode(s, add_special_tokens=False)


def test_the_grammar_drafts_what_it_forces_and_cuts_what_it_forbids(grammar, engine):
    g, enc = grammar
    m = g.mask.constraint.matcher
    start = m.compute_ff_tokens()
    assert g.ahead() and len(start) >= 2
    forced = g.forced(start[0], 8)
    assert forced == start[1:9] and m.compute_ff_tokens() == start  # (state unchanged)
    # A guess is cut at the first token the grammar refuses ...
    m.consume_tokens(start)  # ('{"description_of_item":')
    value = enc(' "abc", "is_available_now": true, "number_of_units": 5}')
    pending, rest = value[0], value[1:]
    assert g.valid(pending, rest) == rest[:-1]        # ... before the one completing it,
    bad = enc(' "abc", "is_available": true')
    assert len(g.valid(bad[0], bad[1:])) < len(bad) - 2
    eos = next(iter(engine.eos))
    assert g.valid(pending, rest[:3] + [eos] + rest[3:]) == rest[:3]  # ... and at an EOS
    assert m.compute_ff_tokens() == [] and m.validate_tokens(value) == len(value)
    assert not g.ahead() and g.forced(pending, 8) == []  # (a string: nothing forced)
    # A step consumed the pending token and a draft of 4, and kept 1 of them.
    m.consume_tokens(value[:5])
    g.rollback(3)
    assert m.validate_tokens(value[2:]) == len(value) - 2
    # Complete, it drafts nothing.
    m.consume_tokens(value[2:])
    assert g.mask.constraint.done and not g.ahead() and g.valid(eos, [eos]) == []


def test_a_draft_models_guesses_are_cut_to_the_grammar(engine, monkeypatch):
    """With a draft model (the same weights, unmasked), a grammar's sequence drafts its
    forced tokens and the draft model's guesses cut to what the grammar allows; sampled, the draft model's q verifies its own drafts only (never the forced
    ones), and a seed reproduces valid JSON."""
    from worker.speculative.draft_model import DraftModel

    # (A free string: where the unmasked model's guess is a character the grammar allows,
    # it is the masked model's choice too.)
    req = {"json": dict(json_request(), json_schema={
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})}
    plain, _, plain_steps = run(engine, req, max_draft=0)
    cut, forced = [], []
    real_valid, real_forced = GrammarDraft.valid, GrammarDraft.forced
    monkeypatch.setattr(GrammarDraft, "valid", lambda self, p, d: cut.append(
        len(d) - len(r := real_valid(self, p, d))) or r)
    monkeypatch.setattr(GrammarDraft, "forced", lambda self, p, k: forced.append(
        len(r := real_forced(self, p, k))) or r)
    got, _, steps = run(engine, req, draft=DraftModel(engine.model, 64))
    assert ids(got["json"]) == ids(plain["json"])
    # The draft model's guesses were drafted and cut where the unmasked model would leave
    # the grammar (this random model's always are, inside the string), beside the forced
    # tokens; a row whose drafts are cut to nothing rests as one whose drafts fail.
    asked = [c for c in cut if c]
    assert asked and len(asked) < steps / 4 and run.totals.accepted >= sum(forced) > 0
    sampled = {"s": json_request(temperature=0.9, seed=5)}
    first, _, _ = run(engine, sampled, draft=DraftModel(engine.model, 64))
    assert run.totals.accepted > 0
    second, _, _ = run(engine, sampled, draft=DraftModel(engine.model, 64))
    assert ids(first["s"]) == ids(second["s"]) and first["s"][-1][2] == "stop"
    assert set(json.loads(text(first["s"]))) == set(SCHEMA["required"])


def test_a_forced_draft_is_never_verified_against_a_drafters_q():
    """A sampling drafter's q belongs to its own draft: where the grammar's forced tokens
    are drafted instead, they are verified as one fixed guess (greedy match)."""
    import mlx.core as mx

    from worker.speculative.adaptive import Pace, Speculation, Track

    class Sampling:  # (a drafter that sampled its last draft from q)
        sampling, q = object(), mx.zeros((4, 8))

        def extend(self, tokens):
            pass

    spec = Speculation()
    spec.tracks[1] = t = Track(Sampling(), Pace(8), seq=None)
    assert spec.sampled(1, 3)[1].shape == (3, 8)
    t.forced = True
    assert spec.sampled(1, 3) is None


def test_the_mtp_heads_guesses_are_cut_to_the_grammar(mtp):
    engine, head, _ = mtp
    req = {"json": json_request(), "plain": dict(prompt="Once upon a time", max_tokens=30,
                                                 temperature=0.0)}
    plain, _, _ = run(engine, req, max_draft=0)
    got, _, _ = run(engine, req, mtp_head=head)
    for name in req:
        assert ids(got[name]) == ids(plain[name]), name
    assert got["json"][-1][2] == "stop" and run.totals.accepted > 10
