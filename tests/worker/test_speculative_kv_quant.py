"""Speculative decoding on a quantized KV cache (--kv-bits beside prompt lookup, Predicted
Outputs, a grammar's forced tokens and a draft model), on tiny float32 models whose heads
(32) MLX can quantize: the verify step trims and rolls the quantized batch cache as it
does a full-precision one (mlx-vlm's BatchQuantizedKVCache has the same trim and padding
contract), so the text is the one the same format gives without drafts, alone and in a
batch, and a rejected draft leaves nothing in a stored state."""

from __future__ import annotations

import pytest

from tests.generates import generate
from tests.worker.batchrun import make_batch, turn as run_turn
from tests.worker.test_speculative import FOUR, ids, run
from tests.worker.test_speculative_grammar import json_request
from tests.worker.test_worker_kv_quant import Q4, Q8, SYSTEM, hybrid_kvq, kvq  # noqa: F401
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.quantized import KVFormat
from worker.speculative import verify
from worker.speculative.draft_model import DraftModel

MIXED = dict(FOUR, json=json_request(max_tokens=60))


@pytest.fixture
def trimmed(monkeypatch):
    """The kinds of cache each verify step gave rejected positions back from."""
    seen, real = [], verify._keep_only

    def keep_only(caches, rejected):
        seen.append({type(c).__name__ for c in caches})
        return real(caches, rejected)
    monkeypatch.setattr(verify, "_keep_only", keep_only)
    return seen


def quantized(seen) -> bool:
    return any("Quantized" in kind for kinds in seen for kind in kinds)


@pytest.mark.parametrize("fmt", [Q8, Q4], ids=["8bit", "4bit"])
def test_drafts_on_a_quantized_cache_change_nothing_but_the_steps(kvq, fmt, trimmed):
    engine, _ = kvq
    without, _, plain_steps = run(engine, MIXED, kv_format=fmt, max_draft=0)
    exact = ids(without["predicted"])
    wrong = exact[:10] + [5, 6] + exact[12:]      # (a prediction that departs once)
    for predicted in (exact, wrong):
        trimmed.clear()
        got, seqs, steps = run(engine, MIXED, {"predicted": predicted}, kv_format=fmt,
                               speculative="prompt-lookup")
        for name in MIXED:
            assert ids(got[name]) == ids(without[name]), name
        assert quantized(trimmed) and steps < plain_steps
        assert seqs["predicted"].draft_accepted >= 20
    assert seqs["predicted"].draft_rejected > 0 and run.totals.accepted < run.totals.drafted
    alone, seqs, steps = run(engine, {"predicted": FOUR["predicted"]}, {"predicted": exact},
                             kv_format=fmt)
    assert ids(alone["predicted"]) == exact and seqs["predicted"].draft_accepted >= 20


def test_a_rejected_draft_leaves_nothing_in_a_quantized_stored_state(kvq, trimmed):
    """A turn whose prediction departs (drafts rejected) is kept as a snapshot; the next
    turn resumed from it gives the text of a cold run of the same format."""
    engine, _ = kvq
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), kv_format=Q8)

    def turn(b, prompt, prediction=None, **kw):
        return run_turn(engine, b, prompt, prediction, **kw)

    turn1 = SYSTEM + [1, 2, 3]
    _, reply = turn(make_batch(engine, kv_format=Q8, max_draft=0), turn1)
    guess = reply[:4] + [7, 8, 9] + reply[4:]
    _, got = turn(batch, turn1, guess, keep_as="r1")
    assert got == reply and quantized(trimmed)
    turn2 = turn1 + reply + [40, 41]
    cached, resumed = turn(batch, turn2, resume_from="r1")
    assert cached == len(turn1) + len(reply)
    assert resumed == turn(make_batch(engine, kv_format=Q8, max_draft=0), turn2)[1]


def test_a_hybrid_model_drafts_on_quantized_attention_and_full_precision_state(
        hybrid_kvq, trimmed):
    engine, _ = hybrid_kvq
    without, _, _ = run(engine, FOUR, kv_format=Q8, max_draft=0)
    wrong = ids(without["predicted"])[:8] + [5, 6] + ids(without["predicted"])[10:]
    got, seqs, _ = run(engine, FOUR, {"predicted": wrong}, kv_format=Q8,
                       speculative="prompt-lookup")
    for name in FOUR:
        assert ids(got[name]) == ids(without[name]), name
    assert quantized(trimmed) and seqs["predicted"].draft_rejected > 0


def test_a_batch_that_quantizes_mid_decode_keeps_drafting(kvq, trimmed):
    """--quantized-kv-start just past the longest prompt: the batch starts at full
    precision and converts once a sequence passes it, while its sequences draft."""
    engine, _ = kvq
    longest = max(len(engine.prepare(generate(rid=n, **kw)).ids) for n, kw in FOUR.items())
    fmt = KVFormat.of(8, 32, longest + 8)
    without, _, _ = run(engine, FOUR, kv_format=fmt, max_draft=0)
    got, seqs, _ = run(engine, FOUR, {"predicted": ids(without["predicted"])},
                       kv_format=fmt, speculative="prompt-lookup")
    for name in FOUR:
        assert ids(got[name]) == ids(without[name]), name
    assert quantized(trimmed) and any("BatchKVCache" in kinds for kinds in trimmed)


def test_a_draft_model_drafts_for_a_quantized_model(kvq):
    """The draft keeps its own cache at full precision: its drafts (the same weights) are
    rejected only where the target's quantized keys move a choice."""
    engine, _ = kvq
    without, _, _ = run(engine, FOUR, kv_format=Q8, max_draft=0)
    got, _, _ = run(engine, FOUR, kv_format=Q8, draft=DraftModel(engine.model, 64))
    for name in FOUR:
        assert ids(got[name]) == ids(without[name]), name
    assert run.totals.accepted > 40


def test_the_mtp_head_drafts_for_a_quantized_hybrid_model(models_dir, trimmed):
    """A Qwen3.5-style checkpoint (recurrent layers, attention with heads of 32 quantized)
    drafting with its own MTP head, whose cache stays at full precision."""
    from tests.mtp_model import build_mtp_model
    from tests.worker.test_speculative_mtp import FOUR as MTP_FOUR
    from worker.loading import models
    from worker.loading.mtp_head import load_head
    from worker.text.engine import TextEngine

    path = build_mtp_model(models_dir / "qwen3_5-mtp-kvq", predictable=True,
                           sizes=dict(head_dim=32))
    loaded = models.load(str(path), path.parent)
    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                        loaded.vocab_size)
    without, _, plain_steps = run(engine, MTP_FOUR, kv_format=Q8, max_draft=0)
    got, _, steps = run(engine, MTP_FOUR, kv_format=Q8,
                        mtp_head=load_head(loaded.model, path))
    for name in MTP_FOUR:
        assert ids(got[name]) == ids(without[name]), name
    assert quantized(trimmed) and run.totals.accepted > 40 and steps < plain_steps
