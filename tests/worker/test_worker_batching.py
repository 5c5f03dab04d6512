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
    # (Readings of one model vary up to 4 x on a busy machine, and under the suite's
    # parallel load one read the per-token part 0 three times over: MLX's CPU stream freed
    # early, as measure's docstring says; the fault read 1,400 x, too high.)
    assert busy.per_token <= m.per_token * 10 and busy.prefill(1, 128) > 0, (m, busy)
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
