"""What mlxd changes in mlx-lm's batch machinery (worker/loop/mlx_lm_patches.py), in-process
on the tiny float32 model: a lone sequence on plain caches, its first token at the step
that ends its prompt, prompts moving to decoding without a copy, the padding read once a
batch, filtering and extracting as mlx-lm's own methods do: each the same output as
mlx-lm's own code, with less work."""

from __future__ import annotations

import pytest

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import forward_shapes, make_batch, run_all, steps
from tests.worker.test_worker_batching import alone, gen, tokens


def test_one_sequence_decodes_on_plain_caches_and_gives_mlx_lms_own_output(engine, monkeypatch):
    # worker/loop/mlx_lm_patches.py: a batch of one prefills with a plain cache's mask ("causal":
    # the faster kernels) and decodes on plain KVCaches (no mask, its position counted on
    # the host), as mlx-lm's single-sequence path does; a padded batch keeps its array.
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import BatchKVCache, KVCache

    seen = []
    for cls in (BatchKVCache, KVCache):
        own = cls.make_mask

        def spy(self, N, return_array=False, _own=own, **kw):
            mask = _own(self, N, return_array=return_array, **kw)
            rows = self.left_padding.shape[0] if isinstance(self, BatchKVCache) else "plain"
            seen.append((rows, N, mask if mask is None or isinstance(mask, str) else "array"))
            return mask

        monkeypatch.setattr(cls, "make_mask", spy)
    g = gen("a")
    ids = engine.prepare(g).ids
    solo = tokens(alone(engine, g))
    assert {("plain", 1, None)} == {s for s in seen if s[1] == 1}  # every decode step
    assert (1, len(ids) - 1, "causal") in seen  # the prompt (but its last token)
    raw = [t for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=len(solo))]
    assert solo == raw
    # A one-token prompt: nothing prefilled, the views start from empty caches.
    one = generate(rid="one", prompt_ids=pack_ids([7]), max_tokens=6, temperature=0.0)
    got = tokens(alone(engine, one))
    assert len(got) == 6
    assert got == [t for t, _ in generate_step(mx.array([7]), engine.model, max_tokens=6)]
    seen.clear()
    run_all(make_batch(engine), {n: engine.prepare(gen(n)) for n in ("a", "d")})
    assert (2, 1, "array") in seen  # two sequences of different lengths: padded, masked


def test_a_lone_sequences_plain_caches_go_back_to_the_batch_when_another_joins(engine,
                                                                             monkeypatch):
    """worker/loop/mlx_lm_patches.py: while a sequence decodes alone, no BatchKVCache decodes
    (its steps run on plain views of the layers); when another joins, the views are
    written back first (mlx-lm merges BatchKVCaches only), and once the first has left,
    the one still running decodes on views again. Each gives what it gives alone."""
    from mlx_lm.models.cache import BatchKVCache

    from tests.worker.batchrun import Seq

    batched = []  # (rows, tokens) of each BatchKVCache update
    own = BatchKVCache.update_and_fetch
    monkeypatch.setattr(BatchKVCache, "update_and_fetch", lambda self, k, v: batched.append(
        (k.shape[0], k.shape[2])) or own(self, k, v))
    preps = {"a": engine.prepare(gen("a", max_tokens=12)),
             "c": engine.prepare(gen("c", max_tokens=20))}
    batch = make_batch(engine)
    seqs = {n: Seq(n) for n in preps}
    out = {n: [] for n in preps}

    def step():
        for seq, o in batch.step():
            out[seq.rid].append(o)
        gb = batch.gen._generation_batch
        return gb.__dict__.get("_lone") is not None, len(gb.uids)

    batch.add(seqs["a"], preps["a"])
    alone_steps = []
    while len(out["a"]) < 4:
        alone_steps.append(step())
    # Views from the step after the one that moved it to decoding (mlx-lm's join).
    assert set(alone_steps[-3:]) == {(True, 1)}
    assert not [b for b in batched if b[1] == 1]  # "a" alone: no batched decode step
    batch.add(seqs["c"], preps["c"])
    together = []
    while batch.members:
        together.append(step())
    assert (False, 2) in together   # both decoding, on the BatchKVCaches
    both = together.index((False, 2))
    assert together[-2] == (True, 1)  # "c" alone at its end: on views again (before its
    assert (False, 2) not in together[-2:]  # last step, which leaves the batch empty)
    assert both < len(together) - 2
    assert (2, 1) in batched
    for name in preps:
        assert tokens(out[name]) == tokens(alone(engine, gen(name, max_tokens=len(
            tokens(out[name]))))), name
        assert out[name][-1][2] == "length"


def test_a_lone_sequence_has_its_first_token_at_the_step_that_ends_its_prompt(engine):
    """Batch._first_tokens: alone in the batch, a sequence's first token is read at the
    step that moves it to decoding (not one step later, after the second token's forward
    pass was launched); the next step reports nothing (mlx-lm's report of that token),
    then one token a step. Beside a decoding stream it keeps mlx-lm's order, so that
    stream's step in flight is never stalled (test above)."""
    from tests.worker.batchrun import Seq

    batch = make_batch(engine)
    prep = engine.prepare(generate(rid="a", prompt_ids=pack_ids(list(range(10, 140))),
                                   max_tokens=5, temperature=0.0))
    batch.add(Seq("a"), prep)
    counts = []
    while batch.members:
        counts.append(len(batch.step()))
    chunks = -(-129 // engine.prefill_step)       # 130 prompt tokens, the last one decodes
    assert counts == [0] * chunks + [1, 0, 1, 1, 1, 1]


def test_prompts_that_end_together_move_to_decoding_without_a_copy(engine, monkeypatch):
    """worker/loop/mlx_lm_patches.py: when every prompt in mlx-lm's prompt batch ends at once (a
    lone request, or two of one length), the batch moves to decoding as it is; when one
    ends before another, the one that ends is gathered out of the batch. Neither takes
    mlx-lm's deep copy of the whole batch, and each request gives what it gives alone."""
    from mlx_lm.generate import PromptProcessingBatch

    from worker.loop.sizing import ChunkSizer

    copies = []
    own_copy = PromptProcessingBatch._copy
    monkeypatch.setattr(PromptProcessingBatch, "_copy",
                        lambda self: copies.append(len(self.uids)) or own_copy(self))
    solo = {n: tokens(alone(engine, gen(n))) for n in ("a", "d")}
    same = {"a2": engine.prepare(gen("a")), "a": engine.prepare(gen("a"))}
    out = run_all(make_batch(engine), same)
    assert tokens(out["a"]) == tokens(out["a2"]) == solo["a"]
    # In chunks of 8 tokens, "a" ends its prompt steps before "d" (40 words) does.
    splits = []
    own_split = PromptProcessingBatch.split
    monkeypatch.setattr(PromptProcessingBatch, "split",
                        lambda self, i: splits.append((len(self.uids), len(i))) or own_split(self, i))
    out = run_all(make_batch(engine, chunks=ChunkSizer(8, 8)),
                  {n: engine.prepare(gen(n)) for n in ("a", "d")})
    assert (2, 1) in splits, "a ends its prompt while d is still prefilled"
    assert copies == [], "neither moving nor splitting copies the prompt batch"
    assert {n: tokens(out[n]) for n in ("a", "d")} == solo


def test_joining_and_leaving_apart_reads_the_padding_once_per_batch(engine, monkeypatch):
    """worker/loop/mlx_lm_patches.py: sequences that join one step apart (left padding) and leave
    apart are filtered out of the batch and their caches extracted (for the prompt cache)
    with one read of the padding per batch, not mlx-lm's per-layer methods; each gives
    what it gives alone, and what it leaves in the prompt cache serves its next turn."""
    from mlx_lm.models.cache import BatchKVCache

    from worker.kvcache.prefix import PrefixCache

    per_layer = []
    for name in ("filter", "extract"):
        own = getattr(BatchKVCache, name)
        monkeypatch.setattr(BatchKVCache, name, lambda self, *a, _own=own, _n=name:
                            per_layer.append(_n) or _own(self, *a))
    lengths = {"a": 12, "b": 20, "c": 7, "d": 16}
    preps = {n: engine.prepare(gen(n, max_tokens=k)) for n, k in lengths.items()}
    prefix = PrefixCache(1 << 30)
    out = run_all(make_batch(engine, prefix=prefix), preps, join={"b": 1, "c": 2, "d": 3})
    for name, k in lengths.items():
        assert tokens(out[name]) == tokens(alone(engine, gen(name, max_tokens=k))), name
        assert out[name][-1][2] == "length"
    assert per_layer == []
    # "c" left first: the state extracted for it holds its prompt and answer, and its
    # next turn starts from there with the same output as from scratch.
    ids = engine.prepare(gen("c", max_tokens=7)).ids + tokens(out["c"])
    again = generate(rid="c2", prompt_ids=pack_ids(ids + [5, 6]), max_tokens=6,
                     temperature=0.0)
    batch = make_batch(engine, prefix=prefix)
    from tests.worker.batchrun import Seq

    assert batch.add(Seq("c2"), engine.prepare(again)) >= len(ids) - 1
    cached = []
    while batch.members:
        cached += [o[0] for _, o in batch.step() if o[0] >= 0]
    assert cached == tokens(alone(engine, again))


def test_filtering_a_generation_batch_narrows_every_list_it_keeps(engine):
    """The one-read filter (worker/loop/mlx_lm_patches.py) filters mlx-lm's generation batch
    itself: every per-sequence list the batch keeps must narrow with it (a list mlx-lm
    adds later and the filter misses would pair sequences with others' state)."""
    from tests.worker.batchrun import Seq

    batch = make_batch(engine)
    for name in ("a", "b", "c"):
        batch.add(Seq(name), engine.prepare(gen(name, max_tokens=30)))
    while len(batch.gen._generation_batch) < 3:
        batch.step()
    gb = batch.gen._generation_batch
    before = {k for k, v in vars(gb).items()
              if isinstance(v, list) and len(v) == 3 and k != "prompt_cache"}  # (per layer)
    assert {"uids", "tokens", "_num_tokens", "_matchers", "_next_logprobs"} <= before
    gb.filter([0, 2])
    assert {k for k in before if len(getattr(gb, k)) != 2} == set()
    assert all(c.keys.shape[0] == 2 for c in gb.prompt_cache)
    assert gb._next_tokens.shape[0] == 2


def test_one_read_extract_and_filter_equal_mlx_lms_per_layer_methods(engine):
    """Padded caches (three prompts of different lengths, merged as mlx-lm merges them):
    the batch-level extract and filter give exactly what BatchKVCache's own give."""
    import copy

    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from worker.loop import mlx_lm_patches

    singles = []
    for n in (5, 9, 3):
        cache = make_prompt_cache(engine.model)
        engine.model(mx.array([list(range(10, 10 + n))]), cache=cache)
        singles.append(cache)
    layers = [BatchKVCache.merge([s[i] for s in singles]) for i in range(len(singles[0]))]
    mine, theirs = copy.deepcopy(layers), copy.deepcopy(layers)
    holder = GenerationBatch.__new__(GenerationBatch)
    holder.prompt_cache = mine
    for idx in range(3):
        got, want = holder.extract_cache(idx), [c.extract(idx) for c in theirs]
        for g, w in zip(got, want):
            assert g.offset == w.offset
            assert mx.array_equal(g.keys, w.keys) and mx.array_equal(g.values, w.values)
    mlx_lm_patches._filter(mine, [0, 2])  # drops the longest: the padding left shifts away
    for c in theirs:
        c.filter([0, 2])
    for g, w in zip(mine, theirs):
        assert g._idx == w._idx and g.left_padding.tolist() == w.left_padding.tolist()
        assert g.offset.tolist() == w.offset.tolist()
        assert mx.array_equal(g.keys, w.keys) and mx.array_equal(g.values, w.values)


def alone_then_joined(engine, make, max_tokens: dict, alone_for: int, on_views) -> list:
    """Request "a" alone until it has `alone_for` outcomes, then "c" joins, run to the end
    (`make(name, max_tokens)` their requests): alone, "a" decodes on views
    (`on_views(batch caches, views)`), together the two on the batch caches, and "c"
    alone again at its end; each gives what it gives alone. Each step's (on views, rows)."""
    from tests.worker.batchrun import Seq

    batch = make_batch(engine)
    out = {n: [] for n in max_tokens}

    def step():
        for seq, o in batch.step():
            out[seq.rid].append(o)
        gb = batch.gen._generation_batch
        lone = gb.__dict__.get("_lone")
        return lone is not None and on_views(*lone), len(gb.uids)

    batch.add(Seq("a"), engine.prepare(make("a", max_tokens["a"])))
    seen = []
    while len(out["a"]) < alone_for:
        seen.append(step())
    assert set(seen[-3:]) == {(True, 1)}
    batch.add(Seq("c"), engine.prepare(make("c", max_tokens["c"])))
    while batch.members:
        seen.append(step())
    assert (False, 2) in seen and seen[-2] == (True, 1)
    for name in max_tokens:
        n = len(tokens(out[name]))
        assert tokens(out[name]) == tokens(alone(engine, make(name, n))), name
    return seen


def test_a_lone_sequence_on_a_sliding_window_model_decodes_on_plain_rotating_caches(
        models_dir, monkeypatch):
    """worker/loop/mlx_lm_patches.py on Gemma 3's layout (a 16-token window every other
    layer): alone, a sequence decodes on plain caches, its windows RotatingKVCaches
    without a mask (a BatchRotatingKVCache builds an array one each step), past the
    window's wrap, with mlx-lm's own single-sequence tokens; when another joins, the
    views go back to the batch caches, and the one left decodes on views again. Each
    gives what it gives alone."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    from tests.worker.test_worker_kv_quant import _engine, gen as window_gen

    engine, _ = _engine(models_dir, "tiny-sliding-kvq")
    masks = []  # the rows of each batched decode step's window mask
    own = BatchRotatingKVCache.make_mask
    monkeypatch.setattr(BatchRotatingKVCache, "make_mask", lambda self, N, **kw: (
        N == 1 and masks.append(self.left_padding.shape[0])) or own(self, N, **kw))
    g = window_gen("a", max_tokens=40)
    ids = engine.prepare(g).ids
    solo = tokens(alone(engine, g))
    assert len(solo) == 40 and len(ids) < 16 < len(ids) + 40  # (the window wraps)
    assert masks == []  # every decode step on the views
    raw = [t for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=40)]
    assert solo == raw

    alone_then_joined(  # ("a" alone past its window)
        engine, lambda name, n: window_gen(name, max_tokens=n), {"a": 30, "c": 40}, 20,
        lambda caches, views: any(type(v) is RotatingKVCache for v in views))
    assert 2 in masks  # together on the batch caches


def test_a_lone_sequence_on_a_hybrid_model_decodes_on_views_beside_its_recurrent_caches(
        hybrid_engine):
    """worker/loop/mlx_lm_patches.py on a hybrid model (qwen3_next: GatedDeltaNet layers
    with recurrent state between attention layers, as Qwen3.5's): alone, its attention
    layers decode on KVCache views and its recurrent layers' ArraysCaches stay the batch's
    own objects, with mlx-lm's own single-sequence tokens; when another joins, the views go
    back to the batch caches and each gives what it gives alone."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import ArraysCache, KVCache

    engine = hybrid_engine
    g = gen("a", max_tokens=30)
    ids = engine.prepare(g).ids
    solo = tokens(alone(engine, g))
    raw = [t for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=30)]
    assert solo == raw

    alone_then_joined(engine, lambda name, n: gen(name, max_tokens=n), {"a": 20, "c": 30}, 6,
                      lambda caches, views: {type(v) for v in views} == {KVCache, ArraysCache}
                      and all(v is c for c, v in zip(caches, views) if type(c) is ArraysCache))


def test_a_lone_prompt_prefilled_in_buckets_gives_the_same_output_and_cache(engine, monkeypatch):
    # On CUDA (mlx_lm_patches.BUCKET) a lone prompt's chunk is padded at its end to a
    # multiple of BUCKET and the caches trimmed back: the same tokens and log-probabilities
    # as without, every prefill pass a multiple (or the whole chunk), and the state the
    # prefix cache keeps is the prompt's own (a longer prompt resumes from it and says
    # what it says cold).
    import random

    from worker.kvcache.prefix import PrefixCache
    from worker.loop import mlx_lm_patches

    rng = random.Random(3)
    ids = [rng.randrange(10, 200) for _ in range(150)]  # (64 + 64 + 21 before its last)
    longer = ids + [rng.randrange(10, 200) for _ in range(9)]

    def ask(prompt, batch):
        g = generate(rid="b", prompt_ids=pack_ids(prompt), max_tokens=8, temperature=0.0,
                     logprobs=True)
        return [o for o in steps(engine, engine.prepare(g), batch) if o is not None]

    def cold(prompt):
        return ask(prompt, make_batch(engine))

    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    plain, plain_longer = cold(ids), cold(longer)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    widths = forward_shapes(monkeypatch, type(engine.model))
    batch = make_batch(engine, prefix=PrefixCache(1 << 26))
    padded = ask(ids, batch)
    assert [w[1] for w in widths if w[1] > 1] == [64, 64, 32]  # (21 tokens padded by 11)
    before = len(widths)
    resumed = ask(longer, batch)
    assert [w[1] for w in widths[before:] if w[1] > 1] == [16]  # (its last 9 but one, cached)
    for got, want in ((padded, plain), (resumed, plain_longer)):
        assert len(got) == 8 and tokens(got) == tokens(want)
        assert all(abs(a[3].logprob - b[3].logprob) < 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("lengths, pass_", [
    ((20, 33, 41), (4, 48)),  # (a fourth row: 4 x 48 within the three rows' 3 x 64)
    ((50, 55, 60), (3, 64)),  # (4 x 64 would pass the three rows' chunks: three)
    ((9, 12, 17, 20, 26), (8, 32)),
])
def test_prompts_prefilled_together_in_buckets_give_each_its_own_output(
        engine, monkeypatch, lengths, pass_):
    # Several prompts in one prefill step on CUDA: mlx-lm's right padding to a multiple of
    # BUCKET rather than to the longest, then its `finalize`; the rows rounded up to a
    # power of two (bucket_rows: the last repeated, filtered out after the pass) while
    # that stays within the rows' chunks (make_batch's 64 each). Each prompt its own
    # tokens and log-probabilities, decoding on as the batch shrinks.
    import random

    from worker.loop import mlx_lm_patches

    rng = random.Random(5)
    prompts = {f"p{n}": [rng.randrange(10, 200) for _ in range(n)] for n in lengths}

    def preps():
        return {name: engine.prepare(generate(rid=name, prompt_ids=pack_ids(ids),
                                              max_tokens=4 + len(ids) // 4, temperature=0.0,
                                              logprobs=True))
                for name, ids in prompts.items()}

    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    plain = run_all(make_batch(engine), preps())
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    widths = forward_shapes(monkeypatch, type(engine.model))
    padded = run_all(make_batch(engine), preps())
    assert [w for w in widths if w[1] > 1] == [pass_]  # (every prompt but its last token)
    # (after the pass, the step that reads each prompt's last token: the real rows only)
    assert widths[widths.index(pass_) + 1] == (len(lengths), 1)
    for name in prompts:
        got, want = padded[name], plain[name]
        assert len(got) == len(want) > 4 and tokens(got) == tokens(want), name
        assert all(abs(a[3].logprob - b[3].logprob) < 1e-4 for a, b in zip(got, want))


def test_prompts_within_a_sliding_window_are_prefilled_in_buckets_too(models_dir, monkeypatch):
    # Gemma's layout (a 64-token window every other layer): a lone prompt and three
    # prompts together whose padded pass fits in the window are bucketed (the window's
    # cache trimmed back, or mlx-lm's right padding rolled away), each with its own tokens
    # and log-probabilities, decoding on past the window's wrap; a prompt whose padded
    # pass would wrap the window keeps mlx-lm's own unpadded pass.
    import random

    from tests.worker.test_worker_kv_quant import _engine
    from worker.loop import mlx_lm_patches

    engine, _ = _engine(models_dir, "tiny-sliding-64")
    rng = random.Random(7)
    prompts = {f"p{n}": [rng.randrange(10, 200) for _ in range(n)] for n in (21, 34, 41, 70)}

    def preps(names):
        return {name: engine.prepare(generate(
            rid=name, prompt_ids=pack_ids(prompts[name]), max_tokens=50, temperature=0.0,
            logprobs=True)) for name in names}

    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    plain = {n: run_all(make_batch(engine), preps([n]))[n] for n in prompts}
    plain_together = run_all(make_batch(engine), preps(["p21", "p34", "p41"]))
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    widths = forward_shapes(monkeypatch, type(engine.model))
    # (All but a prompt's last token, in chunks of make_batch's 64: p70's 5 after its
    # first 64 would be 16 that wrap the window.)
    for name, want in (("p21", [(1, 32)]), ("p41", [(1, 48)]), ("p70", [(1, 64), (1, 5)])):
        widths.clear()
        alone = run_all(make_batch(engine), preps([name]))[name]
        assert [w for w in widths if w[1] > 1] == want, name
        assert len(alone) == 50 and tokens(alone) == tokens(plain[name]), name
        assert all(abs(a[3].logprob - b[3].logprob) < 1e-4 for a, b in zip(alone, plain[name]))
    widths.clear()
    together = run_all(make_batch(engine), preps(["p21", "p34", "p41"]))
    assert [w for w in widths if w[1] > 1] == [(3, 48)]
    for name, got in together.items():
        want = plain_together[name]
        assert len(got) == 50 and tokens(got) == tokens(want), name
        assert all(abs(a[3].logprob - b[3].logprob) < 1e-4 for a, b in zip(got, want))


def test_on_cuda_a_cached_start_shorter_than_a_bucket_is_computed_again(engine, monkeypatch):
    # worker/loop/batch.py `cached_start`: with BUCKET set (CUDA), a prompt that shares
    # fewer than BUCKET tokens with an earlier one (a chat template's header) starts from
    # nothing, its pass from nothing; one that shares more resumes. Each says what it
    # says cold.
    import random

    from tests.worker.batchrun import turn
    from worker.kvcache.prefix import PrefixCache
    from worker.loop import mlx_lm_patches

    rng = random.Random(13)
    head = [rng.randrange(10, 200) for _ in range(40)]
    first = head + [rng.randrange(10, 200) for _ in range(20)]
    short = head[:10] + [rng.randrange(10, 200) for _ in range(30)]  # shares 10
    long = head + [rng.randrange(10, 200) for _ in range(5)]         # shares 40

    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    cold = {n: turn(engine, make_batch(engine), ids, max_tokens=6)[1]
            for n, ids in (("short", short), ("long", long))}
    batch = make_batch(engine, prefix=PrefixCache(1 << 26))
    turn(engine, batch, first, max_tokens=6)
    assert turn(engine, batch, short, max_tokens=6)[0] == 10  # (no bucket: taken)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    batch = make_batch(engine, prefix=PrefixCache(1 << 26))
    turn(engine, batch, first, max_tokens=6)
    widths = forward_shapes(monkeypatch, type(engine.model))
    cached, out = turn(engine, batch, short, max_tokens=6)
    assert cached == 0 and out == cold["short"]
    assert [w for w in widths if w[1] > 1] == [(1, 48)]  # (its 39 from nothing, padded)
    cached, out = turn(engine, batch, long, max_tokens=6)
    assert cached >= 16 and out == cold["long"]
