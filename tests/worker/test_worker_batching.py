"""Continuous batching in-process (worker/loop/batch.py) on the tiny float32 model: a request in
a batch gives what it gives alone, whatever joins, leaves or is prefilled beside it."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import make_batch, run_all, steps
from worker.loop.sizing import ChunkSizer, StepMemory
from worker.kvcache.prefix import PrefixCache

PROMPTS = {
    "a": "Once upon a time there was a little model",
    "b": "Hi",
    "c": "The quick brown fox jumps over the lazy dog, and then it runs away",
    "d": "word " * 40,
}


def gen(name: str, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt=PROMPTS[name], **kw)


def tokens(outcomes) -> list[int]:
    return [o[0] for o in outcomes if o[0] >= 0]


def text(outcomes) -> str:
    return "".join(o[1] for o in outcomes)


def alone(engine, g):
    return [o for o in steps(engine, engine.prepare(g)) if o is not None]


def test_greedy_in_a_batch_equals_each_request_alone(engine):
    preps = {n: engine.prepare(gen(n)) for n in PROMPTS}
    together = run_all(make_batch(engine), preps)
    for name in PROMPTS:
        solo = alone(engine, gen(name))
        assert tokens(together[name]) == tokens(solo), name
        assert text(together[name]) == text(solo)
        assert together[name][-1][2] == solo[-1][2] == "length"


def test_a_request_joining_mid_batch_equals_itself_alone(engine):
    preps = {n: engine.prepare(gen(n, max_tokens=30)) for n in ("a", "c")}
    together = run_all(make_batch(engine), preps, join={"c": 9})
    for name in ("a", "c"):
        assert tokens(together[name]) == tokens(alone(engine, gen(name, max_tokens=30)))


def test_cancelling_one_of_four_leaves_the_others_intact(engine):
    batch = make_batch(engine)
    preps = {n: engine.prepare(gen(n)) for n in PROMPTS}
    seqs = {}
    from tests.worker.batchrun import Seq

    for name, prep in preps.items():
        seqs[name] = Seq(name)
        batch.add(seqs[name], prep)
    out = {n: [] for n in PROMPTS}
    for _ in range(8):
        for seq, o in batch.step():
            out[seq.rid].append(o)
    assert out["b"], "b was running"
    batch.remove(seqs["b"])
    assert len(batch) == 3 and batch.reserved == batch.holds(
        [batch.tokens(preps[n]) for n in "acd"])
    while batch.members:
        for seq, o in batch.step():
            out[seq.rid].append(o)
    assert out["b"][-1][2] is None  # it never finished: it left
    for name in "acd":
        assert tokens(out[name]) == tokens(alone(engine, gen(name))), name


def test_stop_strings_and_grammars_are_per_sequence(engine):
    """A stop string cuts one sequence, a JSON schema shapes another, a third is plain:
    each as alone, in one batch."""
    plain = alone(engine, gen("a", max_tokens=40))
    words = text(plain).split()
    stop = next(w for w in words[2:] if len(w) > 2)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    requests = {
        "a": gen("a", max_tokens=40, stop=[stop]),
        "b": generate(rid="b", messages=[{"role": "user", "content": "JSON please"}],
                      max_tokens=120, temperature=0.0, response_format="json_schema",
                      json_schema=schema),
        "c": gen("c", max_tokens=40),
    }
    together = run_all(make_batch(engine), {n: engine.prepare(g) for n, g in requests.items()})
    for name, g in requests.items():
        solo = alone(engine, g)
        assert text(together[name]) == text(solo), name
        assert together[name][-1][2] == solo[-1][2]
    assert stop not in text(together["a"]) and together["a"][-1][2] == "stop"
    import json

    assert together["b"][-1][2] == "stop"  # the grammar completed
    assert isinstance(json.loads(text(together["b"]))["ok"], bool)


def test_seeded_requests_reproduce_their_solo_output_in_a_batch(engine):
    requests = {n: gen(n, temperature=1.0, seed=seed, max_tokens=20)
                for n, seed in (("a", 7), ("c", 11), ("d", -3))}
    together = run_all(make_batch(engine), {n: engine.prepare(g) for n, g in requests.items()})
    for name, g in requests.items():
        assert tokens(together[name]) == tokens(alone(engine, g)), name
    # Different seeds, different samples (the key is per sequence, not shared).
    assert tokens(together["a"]) != tokens(alone(engine, gen("a", temperature=1.0, seed=8,
                                                            max_tokens=20)))


def test_logprobs_in_a_batch_match_alone(engine):
    g = gen("c", max_tokens=12, logprobs=True, top_logprobs=3)
    preps = {"c": engine.prepare(g), "a": engine.prepare(gen("a")), "d": engine.prepare(gen("d"))}
    together = run_all(make_batch(engine), preps)["c"]
    solo = alone(engine, g)
    for mine, ref in zip(together, solo):
        assert mine[0] == ref[0]
        if ref[3] is not None and ref[3].logprob is not None:
            assert mine[3].logprob == pytest.approx(ref[3].logprob, abs=1e-4)
            assert [t for t, _ in mine[3].top] == [t for t, _ in ref[3].top]
            assert mine[3].top[0][0] == mine[0]  # greedy: the best is the one taken


def test_a_long_prefill_does_not_stall_running_streams(engine):
    """Each step decodes every running stream and prefills ONE chunk of a new prompt:
    the stream gets a token at every step while 1500 prompt tokens go in."""
    batch = make_batch(engine, prefill_batch=1)
    from tests.worker.batchrun import Seq

    running, long = Seq("run"), Seq("long")
    batch.add(running, engine.prepare(gen("a", max_tokens=200)))
    while not batch.step():
        pass  # until the stream decodes (its first token is read as soon as computed:
    batch.step()  # the step after it reports none, see Batch._first_tokens)
    long_prep = engine.prepare(generate(rid="long", prompt_ids=pack_ids([10 + i % 1000 for i in range(1500)]),
                                        max_tokens=2, temperature=0.0))
    batch.add(long, long_prep)
    chunks = -(-1499 // engine.prefill_step)
    first_long = None
    for i in range(chunks + 3):
        produced = {seq.rid for seq, _ in batch.step()}
        assert "run" in produced, f"step {i}: the running stream got no token"
        if "long" in produced and first_long is None:
            first_long = i
    assert first_long is not None and first_long >= chunks  # it was prefilled in chunks


def test_the_kv_budget_bounds_what_joins(engine):
    """Each sequence reserves the KV of its prompt plus its token budget, in a batch
    whose rows are all as long as the longest; the next one waits while what the batch
    would hold passes the budget, and one alone always runs."""
    probe = make_batch(engine)
    p1, p2 = engine.prepare(gen("a", max_tokens=100)), engine.prepare(gen("c", max_tokens=100))
    assert probe.need(p1) == probe.kv.of(len(p1.ids) + 100) > 0
    both = probe.holds([probe.tokens(p1), probe.tokens(p2)])
    assert both > probe.need(p1) + probe.need(p2)  # padded to the longest, 256 at a time
    batch = make_batch(engine, kv_budget=both - 1, prefix=PrefixCache(1 << 20))
    from tests.worker.batchrun import Seq

    assert batch.fits(p1)
    batch.add(Seq("1"), p1)
    assert not batch.fits(p2)  # one byte short
    # The prompt cache gives way to what the running sequence holds, not only its KV.
    assert batch.kvcache.prefix.max_bytes == 1 << 20
    assert batch.reserved == probe.holds([probe.tokens(p1)])
    roomy = make_batch(engine, kv_budget=both)
    roomy.add(Seq("1"), p1)
    assert roomy.fits(p2)
    full = make_batch(engine, max_size=1)
    full.add(Seq("1"), p1)
    assert not full.fits(p2)  # no free slot


def test_a_batch_holds_every_row_as_long_as_its_longest_and_a_steps_logits(engine):
    """mlx-lm's batch cache pads each row to the longest and grows 256 tokens at a time;
    a decode step adds three float32 rows of logits per sequence."""
    batch = make_batch(engine, step_memory=StepMemory(10.0, 1.0, 1000))
    kv, logits = batch.kv, 1000 * 4 * 3
    assert batch.holds([]) == 0
    assert batch.holds([100]) == kv.of(256) + logits
    assert batch.holds([10, 300, 20]) == 3 * kv.of(512) + 3 * logits
    assert batch.holds([10, 300, 20]) > sum(kv.of(n) for n in (10, 300, 20))


def long_prompt(rid: str, n: int):
    return generate(rid=rid, prompt_ids=pack_ids([10 + i % 1000 for i in range(n)]),
                    max_tokens=2, temperature=0.0)


def test_a_prefill_chunk_fits_what_the_running_sequences_leave_of_the_budget(engine):
    """A chunk's working memory: its activations, and attention scores of its size times
    what it attends to (at most its prompt). The chunk is halved until the prompts this
    step prefills (one here, whatever --prefill-batch-size allows) fit beside the batch's
    KV, down to MIN_CHUNK, and the prompt cache gives way to it."""
    from tests.worker.batchrun import Seq
    from worker.loop.sizing import MIN_CHUNK

    memory = StepMemory(100.0, 1.0, 0)
    p1 = engine.prepare(long_prompt("1", 1500))
    probe = make_batch(engine, step_memory=memory)
    held, prompt = probe.holds([probe.tokens(p1)]), len(p1.ids)

    def chunk_within(budget, spare=None):
        batch = make_batch(engine, prefill_batch=2, kv_budget=budget, step_memory=memory,
                           chunks=ChunkSizer(1024, 1024), prefix=PrefixCache(1 << 30),
                           spare=spare)
        batch.add(Seq("1"), p1)
        batch._fit_chunk()
        return batch

    assert memory.prefill(1, 1024, prompt - 1024) == 1024 * (100 + prompt)
    roomy = chunk_within(held + memory.prefill(1, 1024, prompt - 1024))
    assert roomy.gen.prefill_step_size == 1024
    tight = chunk_within(held + memory.prefill(1, 256, prompt - 256))
    assert tight.gen.prefill_step_size == tight.gen._prompt_batch.prefill_step_size == 256
    assert chunk_within(held + 1).gen.prefill_step_size == MIN_CHUNK
    # Device memory to spare (a GPU's free memory, read before the chunk): the chunk
    # borrows it, and the prompt cache keeps the budget's room.
    lent = chunk_within(held + 1, spare=lambda: memory.prefill(1, 1024, prompt - 1024))
    assert lent.gen.prefill_step_size == 1024
    # A group's rank measures nothing: it runs the chunk the leader chose, whatever.
    rank = make_batch(engine, kv_budget=1, chunks=ChunkSizer(1024, 1024))
    rank.add(Seq("1"), p1)
    rank._fit_chunk()
    assert rank.gen.prefill_step_size == 1024


def test_a_cold_2000_token_prompt_under_the_default_budget_takes_one_chunk_where_memory_allows(
        engine):
    """Issue 36: on an H100 the default server (--kv-budget 1G, --prefill-batch-size 2)
    took 110 ms for a cold 2,000-token prompt on the 0.5B shape, the same server with
    --kv-budget 24G 21 ms: a GPU's prefill activations (about a megabyte a token there,
    injected here) do not fit 1 GiB in big chunks, and every chunk is a forward pass the
    CPU launches. Where the device has memory to spare the chunk borrows it: one chunk of
    the sizer's 2048, as with the big budget; without any, chunks of what 1 GiB holds for
    the one prompt being prefilled (not for two: the prefill batch's other row is empty)."""
    from protocol.settings import BY_NAME
    from tests.worker.batchrun import Seq

    default = {name: s.default for name, s in BY_NAME.items()}
    memory = StepMemory(1 << 20, 0.0, engine.vocab_size)  # a GPU's order of magnitude

    def chunks(spare):
        batch = make_batch(engine, kv_budget=default["kv_budget"],
                           prefill_batch=default["prefill_batch_size"], step_memory=memory,
                           chunks=ChunkSizer(default["prefill_step"], 2048), spare=spare,
                           prefix=PrefixCache(default["prompt_cache_bytes"]),
                           clock=lambda: 0.0)  # fast steps: the sizer grows at once
        batch.chunks.observe(0.0)
        batch.add(Seq("p"), engine.prepare(long_prompt("p", 2000)))
        sizes = []  # the prompt tokens each step prefilled (the last one is generation's)
        while batch.members:
            before = batch.gen._counters.prompt_tokens
            batch.step()
            if batch.gen._counters.prompt_tokens > before:
                sizes.append(batch.gen._counters.prompt_tokens - before)
        return sizes

    assert chunks(spare=lambda: 16 << 30) == [1999]                # the whole prompt at once
    assert chunks(spare=None) == [512, 512, 512, 463]   # 1 GiB: 512 tokens a step (not 256)


def test_the_prompt_cache_holds_no_more_than_it_counts(engine):
    """A finished sequence's state is a lazy copy of its row of the batch's arrays: kept
    unevaluated, each entry held the batch's arrays alive, every row of every layer,
    while the prompt cache counted one row (issue 30 item 8: on SmolLM2, 550 MiB held
    for 14 MiB counted after 16 requests)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    prefix = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=prefix)
    preps = {name: engine.prepare(gen(name, max_tokens=12)) for name in PROMPTS}
    run_all(batch, preps, join={"c": 3, "d": 5})
    batch.close()
    del batch
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - base
    assert prefix.nbytes > 0 and len(prefix) >= 3
    assert held <= prefix.nbytes + (64 << 10), (held, prefix.nbytes)  # 900 KB before


def test_step_memory_is_measured_from_two_prefills(engine):
    m = StepMemory.measure(engine.model, engine.vocab_size)
    assert m.per_token > 0 and m.per_pair >= 0 and m.vocab == engine.vocab_size
    # Cyclic garbage holding arrays, collected mid-reading, once read as working
    # memory (the active memory the peak is taken against fell): the reading clears it
    # first and holds the collector off. The model below collects where an automatic
    # collection could have.
    class Node:
        pass

    class Collecting:
        def __init__(self, model):
            self._model = model

        def __getattr__(self, name):
            return getattr(self._model, name)

        def __call__(self, *args, **kw):
            gc.collect()
            return self._model(*args, **kw)

    for _ in range(64):
        a, b = Node(), Node()
        a.other, b.other, a.x = b, a, mx.ones((256, 1024))
        mx.eval(a.x)
    del a, b
    busy = StepMemory.measure(Collecting(engine.model), engine.vocab_size)
    # (Readings of one model vary up to 4 x on a busy machine; the fault read 1,400 x.)
    assert busy.per_token > 0 and m.per_token / 10 <= busy.per_token <= m.per_token * 10, \
        (m, busy)
    assert m.prefill(2, 512, 1000) == int(2 * 512 * (m.per_token + m.per_pair * 1512))


def test_prefill_chunks_grow_while_steps_are_fast_and_shrink_when_slow():
    from worker.loop.sizing import ChunkSizer

    sizer = ChunkSizer(512, 2048, target=0.1)
    assert [sizer.observe(0.04) for _ in range(3)] == [1024, 2048, 2048]  # fast: up to the top
    assert sizer.observe(0.15) == 2048  # between the target and twice it: kept
    assert [sizer.observe(0.3) for _ in range(3)] == [1024, 512, 512]  # slow: back to the floor
    fixed = ChunkSizer(64, 64)
    assert {fixed.observe(t) for t in (0.0, 1.0)} == {64}
    # Far under the target: at once to the size the step's time allows (0.01 s x 8 < 0.1),
    # so a first long prompt takes one chunk at the floor and the rest in the next.
    sizer = ChunkSizer(512, 8192, target=0.1)
    assert [sizer.observe(0.01) for _ in range(2)] == [4096, 8192]


def test_the_batch_prefills_in_chunks_of_the_sizers_size(engine):
    """Injected step times: fast steps grow the chunk, so a 1000-token prompt needs fewer
    steps than at the fixed size, and the tokens are the same."""
    from worker.loop.sizing import ChunkSizer

    g = generate(rid="p", prompt_ids=pack_ids([10 + i % 1000 for i in range(1000)]),
                 max_tokens=4, temperature=0.0)
    fixed = [o for o in steps(engine, engine.prepare(g), make_batch(engine))]
    slow_clock = make_batch(engine, chunks=ChunkSizer(64, 512),
                            clock=iter(range(10 ** 6)).__next__)
    # The injected clock advances 1 "second" a reading: every step looks slow ...
    slow = [o for o in steps(engine, engine.prepare(g), slow_clock)]
    assert slow_clock.chunks.size == 64 and len(slow) == len(fixed)
    quick = make_batch(engine, chunks=ChunkSizer(64, 512), clock=lambda: 0.0)  # ... or instant
    grown = [o for o in steps(engine, engine.prepare(g), quick)]
    assert quick.chunks.size == 512 and quick.gen.prefill_step_size == 512
    assert grown.count(None) < fixed.count(None)  # fewer prefill steps
    assert [o[0] for o in grown if o] == [o[0] for o in fixed if o]


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


def test_short_prompts_that_arrive_together_are_prefilled_together(engine):
    """`--prefill-batch-size` bounds a step's prefill work at that many chunks'
    positions: long prompts go that many a step, short ones arriving together all in one
    step (a lent H200's 2b Gemma 4: eight 22-token prompts two a step waited 0.2-1.8 s
    for their first tokens). The text is each one's alone."""
    from tests.worker.batchrun import Seq

    def first_step(prompts: dict) -> tuple[int, dict]:
        batch = make_batch(engine, prefill_batch=2)
        for name, ids in prompts.items():
            batch.add(Seq(name), engine.prepare(generate(
                rid=name, prompt_ids=pack_ids(ids), max_tokens=4, temperature=0.0)))
        out, first = {n: [] for n in prompts}, None
        while batch.members:
            got = batch.step()
            if got and first is None:
                first = len(got)
            for seq, o in got:
                out[seq.rid].append(o)
        return first, {n: tokens(o) for n, o in out.items()}

    chunk = engine.prefill_step  # (eight prompts within two chunks' tokens)
    short = {f"s{i}": [10 + i + j for j in range(chunk // 8 - 1 - i % 3)] for i in range(8)}
    together, texts = first_step(short)
    assert together == 8
    for name, ids in list(short.items())[:3]:
        assert texts[name] == first_step({name: ids})[1][name]
    long = {f"l{i}": [10 + (i * 7 + j) % 900 for j in range(chunk + 5)] for i in range(4)}
    assert first_step(long)[0] == 2   # (two chunks' work a step, as before)


def test_prompts_for_a_step_count_their_padded_positions_up_to_the_chunks_allowed():
    from types import SimpleNamespace

    from worker.loop.sizing import prompts_for_step

    def gen(waiting, running=()):
        return SimpleNamespace(_unprocessed_sequences=[(0, [[1] * n]) for n in waiting],
                               _currently_processing=[[[[1] * n], 0, n] for n in running])

    assert prompts_for_step(gen([22] * 8), 512, 2, 8) == 8
    assert prompts_for_step(gen([22] * 20), 512, 2, 8) == 8        # (the batch's size)
    assert prompts_for_step(gen([600] * 4), 512, 2, 8) == 2        # long: two a step
    # (A step's prompts are right-padded to its widest: a chunk of a long one beside
    # short ones costs each of them a chunk's positions.)
    assert prompts_for_step(gen([600, 22, 22, 600]), 512, 2, 8) == 2
    assert prompts_for_step(gen([22, 22, 22, 600]), 512, 2, 8) == 3
    assert prompts_for_step(gen([300, 300, 300, 300]), 512, 2, 8) == 3
    # (...and never more than twice what they hold: a longer one waits, not pads them.)
    assert prompts_for_step(gen([20] * 7 + [120]), 512, 2, 8) == 7
    assert prompts_for_step(gen([120] + [20] * 7), 512, 2, 8) == 2
    assert prompts_for_step(gen([20, 25, 30, 22, 28, 35, 21, 24]), 512, 2, 8) == 8
    assert prompts_for_step(gen([22] * 4, running=[1000, 1000]), 512, 2, 8) == 2
    assert prompts_for_step(gen([]), 512, 2, 8) == 2               # (mlx-lm's bound)
