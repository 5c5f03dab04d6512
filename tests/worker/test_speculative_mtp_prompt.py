"""The MTP head reads the prompt (worker/speculative/mtp_prefill.py): after a sequence's
prefill its head cache holds every prompt position, its first draft is the one the head
makes over the whole prompt (computed here directly), the text at temperature 0 stays
the target's (a prompt longer than a prefill chunk, alone, in a batch of four, resumed
from the prefix cache with the head's state kept beside it), and what admission counts
for the head's cache stays true."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from tests.worker.test_speculative import ids, run
from tests.worker.test_speculative_mtp import FOUR, mtp  # noqa: F401
from worker.speculative.mtp import MAX_DRAFT, MTPDrafter, MTPSpeculation, body_and_head

LONG = dict(prompt="Hello there, the quick brown fox jumps over the lazy dog. " * 12,
            max_tokens=40, temperature=0.0)


def perturbed(engine, path, scale: float, hidden: bool = True):
    """The `predictable` head, whose attention (and `hidden`: its input of the target's
    hidden state) `scale` of random weights make count: it ignores both, so that the
    prompt would not matter to its drafts; the larger `scale`, the fewer it guesses."""
    from worker.loading.mtp_head import load_head
    head = load_head(engine.model, path)
    attn = head.layers[0].self_attn
    attn.o_proj.weight = mx.random.normal(attn.o_proj.weight.shape,
                                          key=mx.random.key(3)) * scale
    if hidden:
        size = head.fc.weight.shape[0]
        head.fc.weight = mx.concatenate([head.fc.weight[:, :size], mx.random.normal(
            (size, size), key=mx.random.key(4)) * scale], axis=1)
    return head


@pytest.fixture()
def attentive(mtp):  # noqa: F811
    engine, _, path = mtp
    return engine, perturbed(engine, path, 0.5)


def reference_draft(engine, head, prompt: list, k: int) -> list:
    """The head's first draft computed directly: the target's body over the prompt, its
    first token (greedy), then the head over every position (each hidden state with the
    token after it, the last one's with the first token) and its chain of k."""
    body, lm_head = body_and_head(engine.model)
    hidden = body(mx.array([prompt]), cache=make_prompt_cache(engine.model))
    first = mx.argmax(lm_head(hidden[:, -1]), axis=-1).item()
    cache = [KVCache() for _ in head.layers]
    h = head(body.embed_tokens(mx.array([prompt[1:] + [first]])), hidden, cache)[:, -1:]
    out = []
    for _ in range(k):
        out.append(mx.argmax(lm_head(h)[:, -1], axis=-1).item())
        h = head(body.embed_tokens(mx.array([[out[-1]]])), h, cache)
    return out


def test_the_heads_cache_holds_the_prompt_and_its_first_draft_reads_it(attentive):
    engine, head = attentive
    prep = engine.prepare(generate(rid="long", **LONG))
    prompt = list(prep.ids)
    assert len(prompt) > 2 * engine.prefill_step  # (three chunks at least)
    b = make_batch(engine, speculative="mtp", mtp_head=head)
    seq = Seq("long")
    b.add(seq, prep)
    drafter = b.speculation.tracks[seq.uid].drafter
    assert isinstance(drafter, MTPDrafter)
    steps = 0
    while drafter.guess is None:
        b.step()
        steps += 1
        if steps <= 2:  # (mid-prefill: the chunks so far, in its own head cache)
            assert drafter.length == steps * engine.prefill_step - 1
    # The step that sampled its first token drafted: every prompt position is in its row.
    assert drafter.joined and drafter.length == len(prompt)
    row = b.speculation.batch.order.index(drafter)
    cache = b.speculation.batch.cache[0]
    assert cache.offset[row].item() == len(prompt) + b.speculation.chained
    k = min(MAX_DRAFT, b.speculation.tracks[seq.uid].pace.length)
    assert drafter.guess.tolist() == reference_draft(engine, head, prompt, k)


def test_greedy_text_is_identical_with_a_long_prompt_alone_and_in_a_batch_of_four(mtp):  # noqa: F811
    engine, head, _ = mtp
    four = dict(FOUR, mtp=LONG, story=dict(LONG, prompt="Write a story " * 30))
    without, _, _ = run(engine, four)
    with_, _, _ = run(engine, four, speculative="mtp", mtp_head=head)
    for name in four:
        assert ids(with_[name]) == ids(without[name]), name
    alone, _, steps = run(engine, {"mtp": LONG}, speculative="mtp", mtp_head=head)
    assert ids(alone["mtp"]) == ids(without["mtp"])
    totals = run.totals
    assert 0 < totals.accepted < totals.drafted and steps < 40 * 2 / 3


def test_a_turn_resumed_from_the_prefix_cache_keeps_its_text(mtp):  # noqa: F811
    """The next turn prefills only what is new: its head resumes from the head's state
    kept with the cached part and reads those positions, so it holds the whole prompt
    (worker/speculative/mtp_state.py), and the text is the one from scratch."""
    from protocol.messages import pack_ids
    from worker.kvcache.prefix import PrefixCache
    engine, head, _ = mtp

    def turn(batch, prompt):
        prep = engine.prepare(generate(rid="t", prompt_ids=pack_ids(prompt), max_tokens=16,
                                       temperature=0.0))
        seq = Seq("t")
        cached = batch.add(seq, prep)
        drafter = getattr(batch.speculation.tracks.get(seq.uid), "drafter", None)
        out, read = [], None
        while batch.members:
            out += [o[0] for _, o in batch.step() if o[0] >= 0]
            if read is None and drafter is not None and drafter.joined:
                read = drafter.length  # (its head's positions when it started)
        return cached, out, read

    turn1 = [10 + (i * 7) % 900 for i in range(150)]
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    _, reply, read = turn(batch, turn1)
    assert read == len(turn1)
    turn2 = turn1 + reply + [30, 31, 32]
    cached, out, read = turn(batch, turn2)
    assert cached >= len(turn1)
    assert read == len(turn2)
    assert out == turn(make_batch(engine), turn2)[1]
    totals = batch.speculation.totals  # (drafts kept and drafts rolled back)
    assert 0 < totals.accepted < totals.drafted


def test_the_heads_cache_stays_within_what_admission_counts(mtp, monkeypatch):  # noqa: F811
    """Each pass grows every row of the head's cache by the widest row's new positions (a
    narrower row's padding rolled left): the rows are laid out again before the cache
    holds more positions a row than admission counts for the longest row's reservation
    (its prompt and token budget, rounded up as batch.py's `holds` does). A small KV
    step here, so that the tiny requests reach that bound; the other rule (padding past
    half the longest row) off. The head guesses some drafts whole and misses others, so
    the widest row changes from pass to pass (without the rule its cache held 22
    positions a row past the reservation)."""
    engine, _, path = mtp
    head = perturbed(engine, path, 0.2, hidden=False)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    monkeypatch.setattr("worker.speculative.mtp.COMPACT_AT", 100.0)
    over, compacted = [], []
    draft, compact = MTPSpeculation._draft, MTPSpeculation._compact

    def checked(self, seen):
        out = draft(self, seen)
        reserved = max(d.reserved for d in self.batch.order)
        counted = -(-reserved // 8) * 8
        over.append(self.batch.cache[0]._idx - counted)
        return out

    monkeypatch.setattr(MTPSpeculation, "_draft", checked)
    monkeypatch.setattr(MTPSpeculation, "_compact", lambda self: compacted.append(
        compact(self)) or compacted[-1])
    monkeypatch.setattr("worker.speculative.adaptive.MIN_GAIN", -1.0)  # (none rests)
    reqs = {"a": dict(FOUR["mtp"], max_tokens=60), "b": dict(FOUR["story"], max_tokens=60),
            "c": dict(prompt="Write a story about", max_tokens=60, temperature=0.0)}
    without, _, _ = run(engine, reqs)
    got, _, _ = run(engine, reqs, speculative="mtp", mtp_head=head, max_draft=8)
    for name in reqs:
        assert ids(got[name]) == ids(without[name]), name
    # (past the reservation by at most one pass: what KVSize.per_sequence counts)
    assert over and max(over) <= 8 + MAX_DRAFT
    assert any(compacted)
