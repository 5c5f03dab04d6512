"""The MTP head's state travels with the target's (worker/speculative/mtp_state.py): a
prompt resumed from a prefix-cache entry or a named snapshot (RAM or disk) has a head
cache equal to the one a cold prefill of the whole prompt gives; an entry trimmed to a
shorter prefix resumes without the head's part and the text stays the target's; the
prefix cache's byte count (what the KV budget and the figures count) holds the head's
part too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protocol.messages import pack_ids
from tests.generates import generate
from tests.mtp_model import build_mtp_model
from tests.worker.batchrun import Seq, make_batch
from tests.worker.test_speculative_mtp import mtp  # noqa: F401  (a fixture)
from worker.kvcache.prefix import PrefixCache, cache_nbytes

TURN1 = [10 + (i * 7) % 900 for i in range(150)]


@pytest.fixture(scope="module")
def attention_only(models_dir):
    """(engine, head) of the checkpoint with attention layers only: a cache that trims."""
    from worker.loading import models
    from worker.loading.mtp_head import load_head
    from worker.text.engine import TextEngine

    path = build_mtp_model(models_dir / "qwen3_5-mtp-attention", full_attention_interval=1,
                           predictable=True)
    loaded = models.load(str(path), path.parent)
    body = loaded.model.language_model.model
    body.ssm_idx = None  # (mlx-lm's class takes its first layer for a recurrent one)
    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                        loaded.vocab_size)
    return engine, load_head(loaded.model, path)


def turn(engine, batch, prompt: list, max_tokens: int = 16, **cache):
    """One greedy request alone in `batch` to its end: (prompt tokens the KV cache
    supplied, tokens generated, the head's cache when its row joined the head's batch,
    that is once the prompt is read: [(keys, values)] per head layer over the positions
    it read, float32 numpy; None without the MTP head). `cache`: PromptCache's fields."""
    prep = engine.prepare(generate(rid="t", prompt_ids=pack_ids(prompt), max_tokens=max_tokens,
                                   temperature=0.0, **cache))
    seq = Seq("t")
    cached = batch.add(seq, prep)
    track = batch.speculation.tracks.get(seq.uid) if batch.speculation else None
    drafter = getattr(track, "drafter", None)
    out, read = [], None
    while batch.members:
        out += [o[0] for _, o in batch.step() if o[0] >= 0]
        if read is None and drafter is not None and drafter.joined:
            rows = batch.speculation.batch
            i = rows.order.index(drafter)
            read = [tuple(np.array(a[..., :drafter.length, :].astype(mx.float32))
                          for a in (row.keys, row.values))
                    for row in (c.extract(i) for c in rows.cache)]
    return cached, out, read


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.allclose(x, y, rtol=1e-4, atol=1e-5)
        for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def as_cold(engine, head, prompt: list, read, out) -> bool:
    """Whether a resumed turn's head cache (`read`) and tokens (`out`) are those of a
    cold prefill of its whole `prompt`."""
    _, cold_out, cold_read = turn(engine, make_batch(engine, speculative="mtp", mtp_head=head),
                                  prompt)
    return read is not None and same(read, cold_read) and out == cold_out


def test_a_turn_resumed_from_the_prefix_cache_has_the_heads_cache_of_a_cold_prefill(mtp):  # noqa: F811
    """A hybrid model (recurrent layers: entries are never trimmed): the next turn
    resumes from the previous one's final state, and another turn that leaves its reply
    from the state kept at the end of its prompt (a checkpoint taken mid-prefill); each
    time the head's cache over the whole prompt is the cold prefill's, and the text too."""
    engine, head, _ = mtp
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    _, reply, _ = turn(engine, batch, TURN1)
    entries = list(batch.kvcache.prefix._lru.values())
    assert entries and all(e.head is not None for e in entries)
    for prompt, least in ((TURN1 + reply + [30, 31, 32], len(TURN1) + len(reply) - 1),
                          (TURN1 + [40, 41, 42, 43], len(TURN1) - 1)):
        cached, out, read = turn(engine, batch, prompt)
        assert cached >= least
        assert as_cold(engine, head, prompt, read, out)
        assert out == turn(engine, make_batch(engine), prompt)[1]


@pytest.mark.parametrize("end", ["first token", "stop string"])
def test_a_turn_that_ended_outside_a_verify_step_keeps_the_heads_state_too(mtp, end):  # noqa: F811
    """A turn that ends with its first token (the step that read its prompt) or on a stop
    string (which mlx-lm's batch does not know: the sequence leaves it mid-stream, its
    head having read the token sampled after its last) keeps the head's state with its
    final state all the same: the next turn resumes with the cold prefill's head cache."""
    engine, head, _ = mtp
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    if end == "first token":
        _, reply, _ = turn(engine, batch, TURN1, max_tokens=1)
    else:
        _, full, _ = turn(engine, make_batch(engine), TURN1)
        stop = engine.tokenizer.decode(full[8:10])
        _, reply, _ = turn(engine, batch, TURN1, stop=[stop])
        assert len(reply) < len(full)
    tokens = max((k[1] for k in batch.kvcache.prefix._lru), key=len)
    assert batch.kvcache.prefix._lru[("", tokens)].head is not None
    prompt = list(tokens) + [30, 31, 32]
    cached, out, read = turn(engine, batch, prompt)
    assert cached == len(tokens)
    assert as_cold(engine, head, prompt, read, out)


def test_a_turn_whose_head_missed_a_step_keeps_no_heads_state(mtp, monkeypatch):  # noqa: F811
    """A plain step (no sequence drafting: mlx-lm's own) gives the head no hidden state:
    its cache skips that position from then on, so the state kept at the turn's end
    carries no head's part, and the next turn's head reads only what is new."""
    from worker.speculative.mtp import MTPSpeculation
    engine, head, _ = mtp
    wants, steps = MTPSpeculation.wants, []

    def once_plain(self, uids):
        steps.append(1)
        return len(steps) != 3 and wants(self, uids)

    monkeypatch.setattr(MTPSpeculation, "wants", once_plain)
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    _, reply, _ = turn(engine, batch, TURN1)
    tokens = max((k[1] for k in batch.kvcache.prefix._lru), key=len)
    assert len(tokens) > len(TURN1) and batch.kvcache.prefix._lru[("", tokens)].head is None
    prompt = list(tokens) + [30, 31, 32]
    cached, out, read = turn(engine, batch, prompt)
    assert cached == len(tokens) and read[0][0].shape[2] == len(prompt) - cached
    assert out == turn(engine, make_batch(engine), prompt)[1]


def test_an_attention_models_entry_resumes_whole_with_its_head_and_trimmed_without(
        attention_only):
    """An attention-only model keeps one entry per conversation (prompt and reply, its
    head's state taken from the verify step it ended in) and trims it to a shorter
    shared prefix: whole, the head resumes with it; trimmed, the entry gives no head's
    part (the hidden state at the cut is not kept), the head reads what follows the
    cached part, and the text at temperature 0 is the one decoding gives without
    drafts."""
    engine, head = attention_only
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    _, reply, _ = turn(engine, batch, TURN1)
    ((_, entry),) = batch.kvcache.prefix._lru.items()
    assert entry.head is not None
    whole = TURN1 + reply + [30, 31, 32]
    cached, out, read = turn(engine, batch, whole)
    assert cached >= len(TURN1) + len(reply) - 1
    assert as_cold(engine, head, whole, read, out)

    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    turn(engine, batch, TURN1)
    other = TURN1[:100] + [50 + i for i in range(20)]
    hit = batch.kvcache.prefix.fetch("", other)
    assert hit.tokens == 100 and hit.head is None  # (trimmed: no head's part)
    cached, out, read = turn(engine, batch, other)
    assert cached == 100
    assert out == turn(engine, make_batch(engine), other)[1]
    # (its head read the new part only: its cache's first position is the prompt's 100th)
    assert read[0][0].shape[2] == len(other) - cached


def test_a_named_snapshot_keeps_the_heads_state_in_memory_and_on_disk(mtp, tmp_path):  # noqa: F811
    """A named state written to the disk tier carries the head's part in the same file
    format (its layers after the model's; mlx-lm's loader still reads the model's); a
    fresh worker resumes from the file with the head's cache of a cold prefill."""
    from mlx_lm.models.cache import load_prompt_cache

    from worker.kvcache.disk import DiskTier
    engine, head, _ = mtp
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    disk.start()
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), disk=disk, speculative="mtp",
                       mtp_head=head)
    _, reply, _ = turn(engine, batch, TURN1, keep_as="resp_1")
    batch.close()
    (path,) = (tmp_path / "kv").glob("*.safetensors")
    assert len(load_prompt_cache(str(path))) == len(engine.model.layers)

    disk = DiskTier(tmp_path / "kv", 1 << 30)
    disk.start()
    fresh = make_batch(engine, prefix=PrefixCache(1 << 30), disk=disk, speculative="mtp",
                       mtp_head=head)
    prompt = TURN1 + reply + [30, 31, 32]
    cached, out, read = turn(engine, fresh, prompt, resume_from="resp_1")
    assert cached >= len(TURN1) + len(reply) - 1
    assert fresh.kvcache.snapshots.hits_disk == 1
    assert as_cold(engine, head, prompt, read, out)


def test_the_prefix_caches_bytes_count_the_heads_part(mtp):  # noqa: F811
    """What the prefix cache holds (the bytes the KV budget makes it give way by, and
    kv_stats reports) is each entry's state and the head's beside it: an entry whose
    state alone fits the bound but not with its head's part is not kept."""
    engine, head, _ = mtp
    batch = make_batch(engine, prefix=PrefixCache(1 << 30), speculative="mtp", mtp_head=head)
    turn(engine, batch, TURN1)
    prefix = batch.kvcache.prefix
    heads = sum(cache_nbytes(e.head) for e in prefix._lru.values())
    assert heads > 0
    assert prefix.nbytes == sum(cache_nbytes(e.cache) for e in prefix._lru.values()) + heads
    assert batch.kv_stats().bytes == batch.gen.prompt_cache_nbytes + prefix.nbytes

    (tokens,) = [list(k[1]) for k, e in prefix._lru.items() if len(k[1]) > len(TURN1)]
    entry = prefix._lru[("", tuple(tokens))]
    state, own = cache_nbytes(entry.cache), cache_nbytes(entry.head)
    small = PrefixCache(state + own - 1)
    assert not small.store("", tokens, entry.cache, entry.head) and small.nbytes == 0
    fits = PrefixCache(state + own)
    assert fits.store("", tokens, entry.cache, entry.head) and fits.nbytes == state + own
    fits.trim_to(state)  # (the budget's room, its head's part short: it goes)
    assert fits.nbytes == 0 and len(fits) == 0
