"""The checkpoint's MTP head as a drafter (`--speculative mtp`, worker/speculative/mtp.py)
on a tiny Qwen3.5-style checkpoint built here in the Hugging Face layout (tests/
mtp_model.py): its head loads by the real weight names, drafts inside the batch on a
hybrid model (recurrent layers whose state a rejected draft must not keep: worker/
speculative/recurrent.py), and changes nothing in the text: at temperature 0 it is the
one decoding gives without drafts, alone and in a batch of four beside a request that
does not speculate and one drafting from its prediction; a seed reproduces."""

from __future__ import annotations

import pytest

from protocol.settings import worker_parser
from tests.generates import generate
from tests.mtp_model import build_mtp_model
from tests.worker.batchrun import Seq, make_batch, run_all
from tests.worker.test_speculative import ids, run, text
from tests.worker.test_worker_vision_batch import (asks, loaded, same, tokens,  # noqa: F401
                                                   vbatch, vlm_engine)
from worker.errors import LoadError
from worker.loading.startup import make_batch as startup_batch
from worker.text.engine import TextEngine


@pytest.fixture(scope="module")
def mtp(models_dir):
    """(engine, head) of the checkpoint whose head guesses well (`predictable`)."""
    from worker.loading import models
    from worker.loading.mtp_head import load_head

    path = build_mtp_model(models_dir / "qwen3_5-mtp", predictable=True)
    loaded = models.load(str(path), path.parent)
    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                        loaded.vocab_size)
    return engine, load_head(loaded.model, path), path


FOUR = {
    "mtp": dict(prompt="Hello there " * 4, max_tokens=40, temperature=0.0),
    "story": dict(prompt="Write a story", max_tokens=30, temperature=0.0),
    "biased": dict(prompt="Hello there", max_tokens=25, temperature=0.0,
                   logit_bias=[(5, 2.0)]),   # a logits processor: never speculates
    "predicted": dict(prompt="The quick brown fox " * 3, max_tokens=30, temperature=0.0),
}


def test_the_head_loads_by_the_checkpoints_names_and_what_cannot_draft_refuses(
        mtp, models_dir, tiny_loaded, tmp_path):
    import mlx.core as mx

    from worker.loading import models
    from worker.loop.sizing import KVSize
    from worker.speculative.mtp import MAX_DRAFT, MTPSpeculation
    from worker.loading.mtp_head import load_head
    engine, head, path = mtp
    stored = mx.load(str(path / "model.safetensors"))
    assert mx.array_equal(head.fc.weight, stored["mtp.fc.weight"])
    # (zero-centred in the file, as Hugging Face's Qwen3.5 stores its norms)
    assert mx.allclose(head.norm.weight, stored["mtp.norm.weight"] + 1.0)
    assert mx.allclose(head.layers[0].input_layernorm.weight, mx.ones(64))
    # A sharded checkpoint: the head is read from the shard its index names.
    import json
    import shutil
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded)
    (sharded / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in stored.items()
                                                   if not k.startswith("mtp.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in stored.items()
                                                   if k.startswith("mtp.")}}
    for name, part in shards.items():
        mx.save_safetensors(str(sharded / name), part)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in shards.items() for k in part}}))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"not read")
    assert mx.array_equal(load_head(engine.model, sharded).fc.weight,
                          stored["mtp.fc.weight"])

    def worker_batch(engine, path, *flags):
        args = worker_parser().parse_args(
            ["--model", "m", "--commands", "c", "--events", "e", "--epoch", "0",
             "--state-dir", str(tmp_path), "--speculative", "mtp", *flags])
        return startup_batch(engine, args, path)

    batch = worker_batch(engine, path)
    assert isinstance(batch.speculation, MTPSpeculation)
    # Admission counts each sequence's head cache: one attention layer's KV (2 heads of
    # 16 float32 keys and values: 256 bytes a token) beside the model's.
    assert batch.kv.per_token == KVSize.measure(engine.model).per_token + 256
    # ...and what one pass of the head may add past the longest row's (mtp.py count_in)
    assert batch.kv.per_sequence == KVSize.measure(engine.model).per_sequence \
        + 256 * (batch.max_draft + MAX_DRAFT)
    bare = build_mtp_model(models_dir / "qwen3_5-bare", mtp=False)
    bare_engine = TextEngine(models.load(str(bare), bare.parent).model, engine.tokenizer,
                             engine.context_length, 64, engine.vocab_size)
    with pytest.raises(LoadError, match="no MTP weights"):
        worker_batch(bare_engine, bare)
    tiny = TextEngine(tiny_loaded.model, tiny_loaded.tokenizer, 4096, 64,
                      tiny_loaded.vocab_size)
    with pytest.raises(LoadError, match="family has no MTP head"):
        worker_batch(tiny, tiny_loaded.path)
    with pytest.raises(LoadError, match="cannot draft with --max-kv-size"):
        worker_batch(engine, path, "--max-kv-size", "256")


def test_greedy_text_is_identical_with_mtp_alone_and_in_a_batch_of_four(mtp):
    engine, head, _ = mtp
    without, _, plain_steps = run(engine, FOUR)
    wrong = ids(without["predicted"])[:8] + [5, 6] + ids(without["predicted"])[10:]
    with_, seqs, _ = run(engine, FOUR, {"predicted": wrong}, speculative="mtp",
                         mtp_head=head)
    for name in FOUR:
        assert ids(with_[name]) == ids(without[name]), name
        assert text(with_[name]) == text(without[name]), name
    assert seqs["predicted"].draft_rejected > 0     # (a departure rolled back)
    alone, _, steps = run(engine, {"mtp": FOUR["mtp"]}, speculative="mtp", mtp_head=head)
    assert ids(alone["mtp"]) == ids(without["mtp"])
    totals = run.totals
    # The head guesses most tokens and misses some: both paths ran (a rejected draft
    # rolls back the recurrent layers' state), in fewer steps than one token each.
    assert 0 < totals.accepted < totals.drafted
    assert steps < 40 * 2 / 3


def test_a_seeded_sampled_request_gives_the_same_text_twice_and_in_a_batch_with_mtp(mtp):
    """Its drafts (sampled from the head's q, drawn with its own keys) and their
    verification do not depend on its batch-mates: a greedy MTP row, one that does not
    speculate and another seeded one, drafting in the same passes of the head."""
    engine, head, _ = mtp
    req = dict(prompt="Hello there " * 4, max_tokens=30, temperature=0.9, seed=7)
    first, _, _ = run(engine, {"s": req}, speculative="mtp", mtp_head=head)
    assert run.totals.drafted > 0
    second, _, _ = run(engine, {"s": req}, speculative="mtp", mtp_head=head)
    assert ids(first["s"]) == ids(second["s"])
    mixed, _, _ = run(engine, {"story": FOUR["story"], "s": req, "biased": FOUR["biased"],
                               "other": dict(req, prompt="Write a story", seed=8)},
                      speculative="mtp", mtp_head=head)
    assert ids(mixed["s"]) == ids(first["s"])
    assert run.totals.accepted > 0


def test_the_head_drafts_for_every_row_in_one_pass_a_step(mtp, monkeypatch):
    """Four streams draft in the head's passes of one: each pass (the new positions, then
    each chained token) reads the head's layer and the LM head once for all four rows.
    (Each prompt's chunk is read into its own row's cache first: one pass a row.)"""
    from mlx_lm.models.cache import BatchKVCache

    from worker.speculative.mtp import MTPHead
    engine, head, _ = mtp
    calls, prompts = [], []
    original = MTPHead.__call__

    def counted(self, embedded, hidden, cache):
        batched = isinstance(cache[0], BatchKVCache)
        (calls if batched else prompts).append(embedded.shape[0])
        return original(self, embedded, hidden, cache)

    monkeypatch.setattr(MTPHead, "__call__", counted)
    req = dict(FOUR["mtp"], max_tokens=24)
    one, _, _ = run(engine, {"a": req}, speculative="mtp", mtp_head=head)
    alone, calls[:] = list(calls), []
    four, _, _ = run(engine, {n: req for n in "abcd"}, speculative="mtp", mtp_head=head)
    assert run.totals.accepted > 0
    for name in "abcd":
        assert ids(four[name]) == ids(one["a"]), name
    assert len(alone) > 2 and set(alone) == {1}
    assert len(calls) == len(alone) and set(calls) == {4}
    assert prompts == [1] * 5  # (the one prompt alone, then the four)


def test_a_rows_drafts_in_the_batch_are_the_ones_it_drafts_alone(mtp, monkeypatch):
    """Beside rows that keep other lengths of their drafts (the head's batch right-padded
    and the padding rolled away), that join later and that leave earlier, each MTP row
    drafts what it drafts alone, step by step (none resting); and its head cache holds
    exactly the positions it kept, as its own count says: its whole prompt's, then each
    step's (the last chain's guesses trimmed before the next pass). The head's attention and the hidden state count here (the `predictable` head
    ignores both)."""
    import mlx.core as mx

    from worker.speculative.mtp import MTPSpeculation
    from worker.loading.mtp_head import load_head
    engine, _, path = mtp
    head = load_head(engine.model, path)
    attn = head.layers[0].self_attn
    attn.o_proj.weight = mx.random.normal(attn.o_proj.weight.shape,
                                          key=mx.random.key(3)) * 0.2
    size = head.fc.weight.shape[0]  # (and the target's hidden state counts: fc's half)
    head.fc.weight = mx.concatenate([head.fc.weight[:, :size], mx.random.normal(
        (size, size), key=mx.random.key(4)) * 0.2], axis=1)
    drafts, kept = {}, {}
    verified, stepped = MTPSpeculation.verified, MTPSpeculation.stepped

    def recorded(self, uid, draft, accepted, tokens, following=None):
        t = self.tracks.get(uid)
        if t is not None and draft:
            drafts.setdefault(t.seq.rid, []).append((list(draft), accepted))
        if t is not None and following is not None:
            kept[t.drafter] = kept.get(t.drafter, prompts[t.seq.rid]) + len(tokens) + 1
        return verified(self, uid, draft, accepted, tokens, following)

    def checked(self):
        stepped(self)
        offsets = self.batch.cache[0].offset.tolist() if self.batch else []
        assert offsets == [kept[d] + self.chained for d in self.batch.order]
        assert [d.length for d in self.batch.order] == [kept[d] for d in self.batch.order]

    monkeypatch.setattr(MTPSpeculation, "verified", recorded)
    monkeypatch.setattr(MTPSpeculation, "stepped", checked)
    # (No row rests: a resting row alone takes mlx-lm's plain steps, whose positions its
    # head never reads, where in a batch its mates' verify steps give it them.)
    monkeypatch.setattr("worker.speculative.adaptive.MIN_GAIN", -1.0)
    # (Its rows laid out again at every pass where it has padding: they draft the same.)
    compacted = []
    compact = MTPSpeculation._compact
    monkeypatch.setattr("worker.speculative.mtp.COMPACT_AT", 0.0)
    monkeypatch.setattr(MTPSpeculation, "_compact",
                        lambda self: compacted.append(compact(self)) or compacted[-1])
    reqs = {"mtp": FOUR["mtp"], "story": FOUR["story"],
            "short": dict(prompt="Write a story about", max_tokens=9, temperature=0.0)}
    prompts = {n: len(engine.prepare(generate(rid=n, **kw)).ids) for n, kw in reqs.items()}
    alone = {}
    for name, kw in reqs.items():
        run(engine, {name: kw}, speculative="mtp", mtp_head=head)
        alone[name], drafts = drafts.pop(name), {}
    b = make_batch(engine, speculative="mtp", mtp_head=head)
    for name in ("mtp", "short"):
        b.add(Seq(name), engine.prepare(generate(rid=name, **reqs[name])))
    for _ in range(3):
        b.step()
    b.add(Seq("story"), engine.prepare(generate(rid="story", **reqs["story"])))
    while b.members:
        b.step()
    for name in reqs:
        assert drafts[name] == alone[name], name
    every = alone["mtp"] + alone["story"]
    assert any(a < len(d) for d, a in every) and any(a for _, a in every)
    assert any(compacted)


def test_cancelling_a_sequence_mid_draft_leaves_the_others_and_the_next_untouched(mtp):
    engine, head, _ = mtp
    reqs = {"mtp": FOUR["mtp"], "story": FOUR["story"]}
    alone = {name: run(engine, {name: kw})[0][name] for name, kw in reqs.items()}
    b = make_batch(engine, speculative="mtp", mtp_head=head)
    seqs, out = {}, {n: [] for n in reqs}
    for name, kw in reqs.items():
        seqs[name] = Seq(name)
        b.add(seqs[name], engine.prepare(generate(rid=name, **kw)))
    while not b.speculation.totals.drafted:  # (a draft proposed and verified)
        for seq, o in b.step():
            out[seq.rid].append(o)
    uid = seqs["mtp"].uid
    b.remove(seqs["mtp"])
    assert uid not in b.speculation.tracks
    b.add(Seq("later"), engine.prepare(generate(rid="later", **FOUR["mtp"])))
    out["later"] = []
    while b.members:
        for seq, o in b.step():
            out[seq.rid].append(o)
    assert text(out["story"]) == text(alone["story"])
    assert text(out["later"]) == text(alone["mtp"])


def test_drafts_on_another_hybrid_family_roll_its_recurrent_state_back(hybrid_engine):
    """Qwen3-Next's recurrent layers (another class than Qwen3.5's) under a prediction
    that departs from the text: the rejected drafts leave its state as decoding left it."""
    req = {"p": dict(prompt="The quick brown fox " * 3, max_tokens=30, temperature=0.0)}
    without, _, _ = run(hybrid_engine, req)
    exact = ids(without["p"])
    wrong = exact[:6] + [5, 6, 7] + exact[9:20] + [8] + exact[21:]
    got, seqs, _ = run(hybrid_engine, req, {"p": wrong})
    assert ids(got["p"]) == exact
    assert seqs["p"].draft_accepted > 0 and seqs["p"].draft_rejected > 0


PENALIZED = dict(prompt="Hello there " * 4, max_tokens=30, temperature=0.0,
                 frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=1.3,
                 logit_bias=[(7, 30.0)])


def test_penalties_and_logit_bias_draft_and_keep_their_text(mtp, engine):
    """A request with penalties and logit_bias drafts (its processors see each drafted
    position with the tokens before it, and its history keeps only what was kept): the
    text is the one decoding gives one token a step, with the MTP head and with a
    prediction that departs from it (on the tiny qwen2 model too)."""
    mtp_engine, head, _ = mtp
    for eng, kw in ((mtp_engine, dict(speculative="mtp", mtp_head=head)), (engine, {})):
        plain, _, _ = run(eng, {"p": dict(PENALIZED, frequency_penalty=0, presence_penalty=0,
                                          repetition_penalty=None, logit_bias=[])})
        want, _, steps = run(eng, {"p": PENALIZED})
        assert ids(want["p"]) != ids(plain["p"])          # (the processors matter)
        exact = ids(want["p"])
        for predicted in (exact, exact[:5] + [exact[4]] * 3 + exact[8:]):
            got, seqs, fewer = run(eng, {"p": PENALIZED}, {"p": predicted}, **kw)
            assert ids(got["p"]) == exact
            assert seqs["p"].draft_accepted > 0
        assert fewer < steps
        if kw:
            mtp_only, _, _ = run(eng, {"p": PENALIZED}, **kw)
            assert ids(mtp_only["p"]) == exact and run.totals.accepted > 0


def test_a_vision_batch_verifies_drafts_at_each_rows_own_positions(vlm_engine, loaded):
    """Image rows decode at their index plus a rotary delta (Qwen's multimodal
    positions): a verify step tells the model which rows it runs, as mlx-lm's own steps
    do, even after another prompt's chunk (a request joining later) ran in between.
    Each request predicted exactly gives its own tokens and log-probabilities, on the
    tiny Qwen2-VL and the tiny Qwen3.5 (recurrent layers rolled back); the tiny Gemma 3's
    and Gemma 4's rotating windows never draft, and their predicted requests still say
    what they say alone."""
    gens = asks(logprobs=True)
    alone = {name: run_all(vbatch(vlm_engine), {name: vlm_engine.prepare(g)})[name]
             for name, g in gens.items()}
    preps = {n: vlm_engine.prepare(g) for n, g in gens.items()}
    for name, prep in preps.items():
        prep.prediction = tokens(alone[name])[:4] + [5] + tokens(alone[name])[5:]
    b = vbatch(vlm_engine)  # (Predicted Outputs draft whatever --speculative says)
    mixed = run_all(b, preps, join={"joins": 3})
    for name in gens:
        assert same(mixed[name], alone[name]), name
    if "gemma" in str(loaded[2]):  # a wrapped sliding window cannot take a draft back
        assert b.speculation is None
    else:
        assert b.speculation.totals.accepted > 0


def test_a_hybrid_models_next_turn_resumes_from_the_state_its_drafted_turn_left(
        hybrid_engine):
    """A turn decoded with drafts (some rejected) stores its final recurrent state; the
    next turn starts from it and says what it says from scratch."""
    from tests.worker.batchrun import turn as run_turn
    from worker.kvcache.prefix import PrefixCache

    def turn(batch, ids, prediction=None):
        return run_turn(hybrid_engine, batch, ids, prediction, max_tokens=12)

    turn1 = [10 + (i * 7) % 900 for i in range(60)]
    _, reply = turn(make_batch(hybrid_engine), turn1)
    batch = make_batch(hybrid_engine, prefix=PrefixCache(1 << 30))
    assert turn(batch, turn1, reply[:4] + [5, 6] + reply[6:])[1] == reply
    assert batch.speculation.totals.accepted < batch.speculation.totals.drafted
    turn2 = turn1 + reply + [30, 31, 32]
    cached, out = turn(batch, turn2)
    assert cached >= len(turn1) + len(reply) - 1
    assert out == turn(make_batch(hybrid_engine), turn2)[1]


def test_a_qwen3_5_vision_checkpoint_drafts_with_its_head_in_the_vision_batch(models_dir,
                                                                               tmp_path):
    """Real Qwen3.5 checkpoints are vision-language ones: the tiny Qwen3.5-VL with an MTP
    head added by its Hugging Face names drafts in the vision batch (image and text
    rows, one joining later), each request's tokens and log-probabilities its own."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model
    from worker.loop.sizing import KVSize
    from worker.speculative.mtp import MTPHead
    from worker.loading.mtp_head import load_head
    from worker.vision.batch import VisionBatch
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    source = build_vision_model(models_dir / "tiny-vision-qwen3.5", family="qwen3.5").path
    path = tmp_path / "vlm-mtp"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(path / "model.safetensors"))
    vlm, processor = load(str(path))  # (the model as built; the head joins its file below)
    lm = shared_language_model(vlm, path)
    for key, value in tree_flatten(MTPHead(lm.language_model.args, 1).parameters()):
        weights["mtp." + key] = value - 1.0 if key.endswith("norm.weight") else value
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    engine = VisionEngine(vlm, processor, 4096, 64, lm=lm)
    gens = asks(logprobs=True)
    alone = {name: run_all(vbatch(engine), {name: engine.prepare(g)})[name]
             for name, g in gens.items()}
    b = VisionBatch(engine, max_size=8, prefill_step=64, prefill_batch=8, kv_budget=1 << 30,
                    kvcache=None, kv=KVSize.measure(engine.model), speculative="mtp",
                    mtp_head=load_head(engine.model, path))
    mixed = run_all(b, {n: engine.prepare(g) for n, g in gens.items()}, join={"joins": 3})
    for name in gens:
        assert same(mixed[name], alone[name]), name
    assert b.speculation.totals.drafted > 0


def test_the_kv_figures_count_the_heads_cache(mtp):
    """Admission counts each sequence's head cache per token (count_in, above), so the KV
    held that status and /metrics report counts it too: the bytes held over the bytes a
    token are the tokens held."""
    engine, head, _ = mtp
    b = make_batch(engine, speculative="mtp", mtp_head=head)
    b.add(Seq("mtp"), engine.prepare(generate(rid="mtp", **FOUR["mtp"])))
    while not b.speculation.totals.drafted:
        b.step()
    held = b.speculation.nbytes()
    assert held > 0 and held == b.speculation.batch.nbytes  # (its prompt read: joined)
    stats = b.kv_stats()
    assert stats.bytes == b.gen.prompt_cache_nbytes + held
    assert stats.tokens == int(stats.bytes // b.kv.per_token)
