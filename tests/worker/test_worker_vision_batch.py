"""A vision-language model's requests on the continuous batch (worker/vision/batch.py),
in-process on the tiny Qwen2-VL, the tiny Qwen3.5 (hybrid), the tiny Gemma 3 (sliding
window layers: rotating caches) and the tiny Gemma 4 (shared-KV layers, per-layer inputs,
as E2B; images attended both ways, as 31B, in test_worker_vision_spans.py): text and image requests mixed in one batch give each
its tokens alone, which are mlx-vlm's own; cancel, joins, grammars and stops per
sequence; the prefix cache keyed by image content, resuming an image turn without the
vision tower."""

from __future__ import annotations

import json

import pytest

from tests.generates import generate
from tests.worker.batchrun import Seq, run_all
from tests.worker.test_worker_vision import png
from tests.worker.test_worker_vision import run as mlx_vlms  # mlx-vlm's own step, serially
from worker.kvcache.prefix import PrefixCache
from worker.vision.engine import KEY


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen3.5", "gemma3", "gemma4"])
def loaded(request, vision_model, models_dir):
    """(mlx-vlm's model, its processor, its path): the tiny Qwen2-VL, the tiny Qwen3.5
    (hybrid linear attention: its recurrent state cannot be trimmed), the tiny Gemma 3
    (a 16-token sliding window every other layer, which every prompt here wraps) and the
    tiny Gemma 4 (Gemma 3's window, its last layers sharing earlier layers' KV, per-layer
    inputs, images of different sizes)."""
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model

    path = vision_model if request.param == "qwen2-vl" else build_vision_model(
        models_dir / f"tiny-vision-{request.param}", family=request.param).path
    return (*load(str(path)), path)


@pytest.fixture(scope="module")
def vlm_engine(loaded):
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    lm = shared_language_model(loaded[0], loaded[2])
    assert lm is not None  # mlx-lm's text class, mlx-vlm's weights
    return VisionEngine(*loaded[:2], 4096, 64, lm=lm)


@pytest.fixture(scope="module")
def serial_engine(loaded):
    from worker.vision.engine import VisionEngine

    return VisionEngine(*loaded[:2], 4096, 64)


def vbatch(engine, prefix: PrefixCache | None = None, max_size: int = 8,
           prefill_step: int | None = None, max_kv_size: int | None = None):
    from worker.kvcache.manager import KVCache, trimmable
    from worker.loop.sizing import KVSize
    from worker.vision.batch import VisionBatch

    kvcache = None if prefix is None else KVCache(
        prefix, trimmable=trimmable(engine.model, max_kv_size))
    return VisionBatch(engine, max_size=max_size, prefill_step=prefill_step or engine.prefill_step,
                       prefill_batch=8, kv_budget=1 << 30, kvcache=kvcache,
                       kv=KVSize.measure(engine.model, max_kv_size), max_kv_size=max_kv_size)


def each_alone(engine, gens: dict) -> dict:
    """Each request's outcomes, run alone in a batch of its own."""
    return {n: run_all(vbatch(engine), {n: engine.prepare(g)})[n] for n, g in gens.items()}


def image_span(batch, ids: list[int]) -> tuple[int, int]:
    """(the index of the first image token in `ids`, one past the last's)."""
    at = [i for i, t in enumerate(ids) if t in batch.media_tokens]
    return at[0], at[-1] + 1


def tokens(outcomes) -> list[int]:
    return [o[0] for o in outcomes]


def same(a, b) -> bool:
    """The same tokens with the same log-probabilities (a rotary position off by the
    image's delta moves them by ~0.05 on the tiny model without changing a token)."""
    return tokens(a) == tokens(b) and all(
        abs(x[3].logprob - y[3].logprob) < 1e-4 for x, y in zip(a, b))


REQUESTS = {
    "image": dict(text="What is this?", images=(png(seed=1),)),
    "joins": dict(text="Describe it please", images=(png(60, 40, seed=2),)),
    "text": dict(text="Hello there, how are you", images=()),
    "two": dict(text="Compare the two", images=(png(seed=3), png(30, 50, seed=4))),
}


def ask(text: str, images: tuple = (), **kw):
    content = [{"type": "text", "text": text}, *({"type": "image"} for _ in images)]
    kw.setdefault("temperature", 0.0)
    return generate(messages=[{"role": "user", "content": content}], images=tuple(images),
                    **kw)


def asks(**kw):
    return {name: ask(rid=name, max_tokens=8, **r, **kw) for name, r in REQUESTS.items()}


def test_text_and_image_requests_mixed_in_one_batch_give_each_its_own_tokens(
        vlm_engine, serial_engine):
    gens = asks(logprobs=True)
    theirs = {name: mlx_vlms(serial_engine, g) for name, g in gens.items()}
    alone = {name: run_all(vbatch(vlm_engine), {name: vlm_engine.prepare(g)})[name]
             for name, g in gens.items()}
    mixed = run_all(vbatch(vlm_engine), {n: vlm_engine.prepare(g) for n, g in gens.items()},
                    join={"joins": 3})
    for name in gens:  # the images' features and positions as mlx-vlm has them
        assert same(alone[name], theirs[name]), name
        assert same(mixed[name], alone[name]), name
    assert len({tuple(tokens(t)) for t in alone.values()}) == 4
    assert all(len(t) == 8 for t in alone.values())


def test_cancelling_one_of_four_leaves_the_others_their_tokens(vlm_engine):
    gens = asks()
    alone = {n: tokens(o) for n, o in each_alone(vlm_engine, gens).items()}
    batch = vbatch(vlm_engine)
    seqs = {n: Seq(n) for n in gens}
    for n, g in gens.items():
        batch.add(seqs[n], vlm_engine.prepare(g))
    out = {n: [] for n in gens}
    steps = 0
    while len(batch):
        for seq, o in batch.step():
            out[seq.rid].append(o[0])
        steps += 1
        if steps == 4:
            batch.remove(seqs["image"])
    assert len(out["image"]) < 8
    assert {n: t for n, t in out.items() if n != "image"} == \
        {n: t for n, t in alone.items() if n != "image"}


@pytest.mark.parametrize("cancel", [False, True])
def test_an_image_prompt_prefills_a_chunk_a_step_beside_a_running_stream(vlm_engine, cancel):
    gens = {"text": ask(rid="text", max_tokens=24, logprobs=True, **REQUESTS["text"]),
            "image": ask(rid="image", max_tokens=4, logprobs=True, **REQUESTS["two"])}
    alone = each_alone(vlm_engine, gens)
    batch = vbatch(vlm_engine, prefill_step=4)  # the image prompt: several 4-token chunks
    seqs = {n: Seq(n) for n in gens}
    out = {n: [] for n in gens}

    def step():
        results = batch.step()
        for seq, o in results:
            out[seq.rid].append(o)
        return {seq.rid for seq, _ in results}

    batch.add(seqs["text"], vlm_engine.prepare(gens["text"]))
    while len(out["text"]) < 2:  # (past its first token, read a step early)
        step()
    batch.add(seqs["image"], vlm_engine.prepare(gens["image"]))
    chunks = 0
    while batch.prefilling:
        assert "text" in step()  # the running stream's token at every step
        chunks += 1
        if cancel and chunks == 2:
            batch.remove(seqs["image"])  # between two chunks of its prefill
    assert (chunks == 2 and len(batch) == 1) if cancel else chunks >= 3
    while len(batch):
        step()
    assert same(out["text"], alone["text"])
    assert out["image"] == [] if cancel else same(out["image"], alone["image"])


def test_a_burst_of_image_chats_prefills_in_one_step_and_none_is_cut_short(vlm_engine):
    """Image prompts share a step's chunk in arrival order: those behind the first that
    fit whole in what it left prefill in the same step (a burst joins the text batch
    together), through the points where the KV cache keeps their state on the way (a
    cache that cannot be trimmed: before the first image); one that does not fit waits,
    untouched, for a chunk of its own."""
    names = ("image", "joins", "two")
    gens = {n: ask(rid=n, max_tokens=4, **REQUESTS[n]) for n in names}
    wide = vbatch(vlm_engine, PrefixCache(1 << 28), prefill_step=2048)
    for n in names:
        wide.add(Seq(n), vlm_engine.prepare(gens[n]))
    assert len(wide.prefilling) == 3
    kept = [list(job.keep) for job in wide.prefilling]
    assert all(kept) == (not wide.kvcache.trimmable)  # (Gemma's windows, Qwen3.5's state)
    # Kept on the way: the state before the first image alone (these prompts are far
    # shorter than the KV cache's checkpoint interval), none just before the last
    # image's end (no later prompt could use it: an extra pass for nothing).
    firsts = [[min(i for i, t in enumerate(job.prep.ids) if t in wide.media_tokens)]
              for job in wide.prefilling]
    assert kept == ([[]] * 3 if wide.kvcache.trimmable else firsts)
    wide.step()
    assert wide.prefilling == [] and len(wide.members) == 3
    # A chunk that the first prompt leaves 2 tokens of: the next, longer, is not begun.
    short = next(job.end for job in _added(vlm_engine, gens, ("image",)).prefilling)
    narrow = _added(vlm_engine, gens, ("image", "two"), prefill_step=short + 2)
    narrow.step()
    (left,) = narrow.prefilling
    assert left.seq.rid == "two" and left.end > 2
    assert left.pos == 0 and left.cache is None  # (not even its vision tower yet)
    assert len(narrow.members) == 1


def _added(engine, gens: dict, names: tuple, prefill_step: int = 2048):
    batch = vbatch(engine, prefill_step=prefill_step)
    for n in names:
        batch.add(Seq(n), engine.prepare(gens[n]))
    return batch


def test_grammars_and_stop_strings_stay_per_sequence_in_a_mixed_batch(vlm_engine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    plain = asks()["two"]
    text = "".join(o[1] for o in run_all(vbatch(vlm_engine),
                                         {"p": vlm_engine.prepare(plain)})["p"])
    stop = text[len(text) // 2:][:3]
    gens = {
        "json": ask(rid="json", max_tokens=120, response_format="json_schema",
                    json_schema=schema, **REQUESTS["image"]),
        "stop": ask(rid="stop", max_tokens=8, stop=[stop], **REQUESTS["two"]),
        "text": ask(rid="text", max_tokens=8, **REQUESTS["text"]),
    }
    alone = each_alone(vlm_engine, gens)
    mixed = run_all(vbatch(vlm_engine), {n: vlm_engine.prepare(g) for n, g in gens.items()})
    assert {n: tokens(o) for n, o in mixed.items()} == {n: tokens(o) for n, o in alone.items()}
    assert mixed["json"][-1][2] == "stop"
    assert isinstance(json.loads("".join(o[1] for o in mixed["json"]))["ok"], bool)
    assert stop not in "".join(o[1] for o in mixed["stop"]) and len(mixed["stop"]) < 8
    assert len(mixed["text"]) == 8


@pytest.fixture
def tower_runs(loaded, monkeypatch):
    """How many times the vision tower ran."""
    tower = type(loaded[0].vision_tower)
    runs = []
    original = tower.__call__

    def counted(self, *a, **kw):
        runs.append(1)
        return original(self, *a, **kw)

    monkeypatch.setattr(tower, "__call__", counted)
    return runs


@pytest.fixture
def processor_runs(loaded, monkeypatch):
    """How many times the image processor ran (worker/vision/processed.py wraps it)."""
    inner = loaded[1].image_processor.inner
    runs = []
    original = type(inner).__call__

    def counted(self, *a, **kw):
        runs.append(1)
        return original(self, *a, **kw)

    monkeypatch.setattr(type(inner), "__call__", counted)
    return runs


@pytest.fixture
def rope_index_runs(loaded, monkeypatch):
    """How many times the model's `get_rope_index` walked a prompt (Qwen's families)."""
    language = type(loaded[0].language_model)
    runs = []
    original = getattr(language, "get_rope_index", None)
    if original is not None:
        def counted(self, *a, **kw):
            runs.append(1)
            return original(self, *a, **kw)

        monkeypatch.setattr(language, "get_rope_index", counted)
    return runs


def one(batch, engine, gen):
    """(tokens, cached prompt tokens) of `gen` run alone on `batch`."""
    seq, out = Seq(gen.rid), []
    cached = batch.add(seq, engine.prepare(gen))
    while len(batch):
        out += [o[0] for _, o in batch.step()]
    return out, cached


def test_the_prefix_cache_knows_an_image_by_its_content(vlm_engine, tower_runs):
    batch = vbatch(vlm_engine, PrefixCache(1 << 28))
    first = ask(rid="a", max_tokens=4, **REQUESTS["image"])
    prep = vlm_engine.prepare(first)
    first_image, image_end = image_span(batch, prep.ids)
    cold, cached = one(batch, vlm_engine, first)
    assert cached == 0 and len(tower_runs) == 1
    # The same words and image again: its prompt from the cache, no vision tower.
    again, cached = one(batch, vlm_engine, first)
    assert again == cold and cached >= image_end and len(tower_runs) == 1
    # The same words about another image: what comes before the image is reused, all of
    # it, where the cache cannot be trimmed too (a state kept at the image's start).
    other = ask(rid="b", max_tokens=4, text=REQUESTS["image"]["text"], images=(png(seed=9),))
    theirs, cached = one(batch, vlm_engine, other)
    assert cached == first_image and len(tower_runs) == 2
    assert theirs == one(vbatch(vlm_engine), vlm_engine, other)[0]


def test_another_question_about_the_same_image_starts_after_it(vlm_engine, tower_runs):
    """The same image with another question (a new chat about a screenshot): the first
    such prompt parts from the earlier one after the image, where a cache that cannot be
    trimmed keeps its state, so the next starts there, without the vision tower, and
    says what it says cold. (Plain caches: the earlier state trimmed back, as before.)"""
    batch = vbatch(vlm_engine, PrefixCache(1 << 28))
    batch.kvcache.branch_min = 4  # (the tiny image is a few dozen tokens)
    image = png(seed=13)  # (a seed of its own: the engine keeps processed images)

    def chat(rid, text):
        return generate(rid=rid, messages=[{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": text}]}], images=(image,),
            max_tokens=4, temperature=0.0)

    one(batch, vlm_engine, chat("a", "Describe it."))
    one(batch, vlm_engine, chat("b", "And what is the second shape here, in a word?"))
    runs = len(tower_runs)
    third = chat("c", "And what is the third shape here, in a word?")
    prep = vlm_engine.prepare(third)
    _, image_end = image_span(batch, prep.ids)
    theirs, cached = one(batch, vlm_engine, third)
    assert cached >= image_end and len(tower_runs) == runs
    assert theirs == one(vbatch(vlm_engine), vlm_engine, third)[0]


def test_the_next_turn_about_an_image_resumes_without_encoding_it_again(
        vlm_engine, tower_runs, processor_runs, rope_index_runs):
    batch = vbatch(vlm_engine, PrefixCache(1 << 28))
    image = png(seed=5)
    turn = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image"}]}]
    answer, _ = one(batch, vlm_engine, generate(rid="1", messages=turn, images=(image,),
                                                max_tokens=6, temperature=0.0))
    assert len(processor_runs) == 1 and len(tower_runs) == 1
    said = vlm_engine.tokenizer.decode(answer)
    turn2 = turn + [{"role": "assistant", "content": said},
                    {"role": "user", "content": "And its colour?"}]
    gen2 = generate(rid="2", messages=turn2, images=(image,), max_tokens=6, temperature=0.0)
    prep2 = vlm_engine.prepare(gen2)
    # Neither the image processor nor the vision tower: the image's processed arrays by
    # its bytes, its state from the KV cache; nor a walk of the prompt for its positions'
    # delta: the first turn's, kept by the image's grid (and the same as the walk's).
    rope_index_runs.clear()  # (the first turn's vision step walked its prompt)
    warm, cached = one(batch, vlm_engine, gen2)
    assert len(processor_runs) == 1 and len(tower_runs) == 1 and not rope_index_runs
    delta = batch._rope_delta(prep2.ids, prep2.media)
    assert delta == vbatch(vlm_engine)._rope_delta(prep2.ids, prep2.media)
    assert len(rope_index_runs) == (delta != 0)  # (Gemma 3: no delta, nothing to walk)
    assert cached >= 1 + max(i for i, t in enumerate(prep2.ids) if t in batch.media_tokens)
    # The same prompt and arrays as the processor makes afresh, and the same answer as a
    # cold prefill of it (the kept pixels through the tower).
    vlm_engine.processed.clear()
    fresh = vlm_engine.prepare(gen2)
    assert len(processor_runs) == 2 and fresh.ids == prep2.ids
    assert fresh.media.keys() == prep2.media.keys() and all(
        (fresh.media[k] == prep2.media[k]).all() for k in fresh.media if k != KEY)
    cold, cold_cached = one(vbatch(vlm_engine), vlm_engine, gen2)
    assert warm == cold and cold_cached == 0 and len(tower_runs) == 2


def test_the_next_text_turn_resumes_from_the_cache(vlm_engine):
    # (Gemma 3's sliding window wraps in the first turn: only a state kept at the prompt's
    # length can serve the next, worker/kvcache/manager.py `checkpoints`.)
    batch = vbatch(vlm_engine, PrefixCache(1 << 28))
    turn = [{"role": "user", "content": "Hello there, how are you doing today?"}]
    gen1 = generate(rid="1", messages=turn, max_tokens=6, temperature=0.0)
    answer, cached = one(batch, vlm_engine, gen1)
    assert cached == 0
    turn2 = turn + [{"role": "assistant", "content": vlm_engine.tokenizer.decode(answer)},
                    {"role": "user", "content": "And tomorrow?"}]
    gen2 = generate(rid="2", messages=turn2, max_tokens=6, temperature=0.0)
    warm, cached = one(batch, vlm_engine, gen2)
    assert cached >= len(vlm_engine.prepare(gen1).ids) - 1  # (its first prompt at least)
    assert warm == one(vbatch(vlm_engine), vlm_engine, gen2)[0]


def test_a_window_of_max_kv_size_batches_text_and_image_requests(vlm_engine):
    # --max-kv-size: every layer a rotating cache of 24, which these prompts wrap; an
    # image prompt's prefill hands it over (worker/vision/batch.py `_carry`; that it
    # hands it over right, Gemma 3's windows show against mlx-vlm above). Not compared
    # with mlx-vlm's own step here: mlx-lm's batch window keeps none of the first tokens
    # its single-sequence one keeps (4), for text models too.
    gens = asks(logprobs=True)
    alone = {n: run_all(vbatch(vlm_engine, max_kv_size=24), {n: vlm_engine.prepare(g)})[n]
             for n, g in gens.items()}
    mixed = run_all(vbatch(vlm_engine, max_kv_size=24),
                    {n: vlm_engine.prepare(g) for n, g in gens.items()}, join={"joins": 3})
    for name in gens:
        assert same(mixed[name], alone[name]), name
    assert all(len(t) == 8 for t in alone.values())
    assert max(len(vlm_engine.prepare(g).ids) for g in gens.values()) > 24


def test_a_worker_batches_a_vision_checkpoint_with_max_kv_size(spawn, vision_model):
    from protocol.messages import Delta, Done, Ready

    w = spawn(vision_model, "--max-kv-size", "1024")
    ready = w.wait_for("ready", timeout=120)[0]
    assert isinstance(ready, Ready) and ready.slots > 1
    w.send(ask("What is this?", (png(),), rid="v", max_tokens=3))
    events = []
    while not any(isinstance(e, Done) for e in events):
        events.append(w.recv(timeout=30))
    assert sum(e.n_tokens for e in events if isinstance(e, Delta)) == 3


def test_the_engine_detokenizes_as_mlx_lm_does_for_the_checkpoint(vlm_engine, loaded):
    """The vision engine's streaming detokenizer is the one mlx-lm's `load` picks from the
    checkpoint's tokenizer.json (not the naive one a bare TokenizerWrapper gets), and
    streams the same text as the tokenizer's own decode."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, load

    theirs = load(loaded[2]).detokenizer
    mine = vlm_engine.tokenizer.detokenizer
    assert type(mine) is type(theirs) and not isinstance(mine, NaiveStreamingDetokenizer)
    ids = vlm_engine.tokenizer.encode("Tell me a story about a model that reads\nevery line.")
    mine.reset()
    for t in ids:
        mine.add_token(t)
    mine.finalize()
    assert mine.text == vlm_engine.tokenizer.decode(ids)
