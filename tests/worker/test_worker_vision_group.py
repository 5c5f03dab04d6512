"""Image prompts of one step prefilled as one left-padded batch (worker/vision/group.py),
in-process on the tiny Qwen2-VL, Qwen3.5 (hybrid), Gemma 3 (whose 4-D image mask keeps
its prompts one by one, as mlx-vlm's own batch does) and Gemma 4 (windows, shared-KV
layers, per-layer inputs): the same tokens and log-probabilities as each prompt alone, in
one forward pass for the burst (two where the KV cache keeps the state before each
image), and the states kept on the way are each prompt's own."""

from __future__ import annotations

import pytest

from tests.worker.batchrun import Seq, forward_shapes, run_all
from tests.worker.test_worker_vision import png
from tests.worker.test_worker_vision_batch import (  # noqa: F401 (fixtures)
    ask, each_alone, image_span, loaded, one, same, vbatch, vlm_engine)
from worker.kvcache.prefix import PrefixCache
from worker.vision.group import Together

# Chats with one image of one size after words of different lengths: rows of different
# lengths whose images line up at the end (left padding).
TEXTS = ("What is this?", "Describe it please", "Tell me about the picture here",
         "Colour?")


@pytest.fixture
def passes(loaded, monkeypatch):
    """The widths (rows, tokens) of mlx-vlm's language model's forward passes."""
    return forward_shapes(monkeypatch, type(loaded[0].language_model))


def burst(seed: int = 10) -> dict:
    return {f"c{i}": ask(rid=f"c{i}", max_tokens=6, logprobs=True, text=text,
                         images=(png(seed=seed + i),)) for i, text in enumerate(TEXTS)}


def run(batch, preps: dict, passes: list) -> tuple[dict, list, list]:
    """Each request's outcomes, `preps` added to `batch` at once and run to the end; the
    widths of the forward passes of its first step (the images' prefill); and the
    prompt tokens each one's start had cached."""
    cached = [batch.add(Seq(n), prep) for n, prep in preps.items()]
    out, first = {n: [] for n in preps}, None
    passes.clear()
    while len(batch):
        for seq, o in batch.step():
            out[seq.rid].append(o)
        first = list(passes) if first is None else first
    return out, first, cached


def test_a_burst_of_image_chats_prefills_as_one_batch_with_each_ones_tokens(
        vlm_engine, passes):
    gens = burst()
    alone = each_alone(vlm_engine, gens)
    batch = vbatch(vlm_engine, PrefixCache(1 << 28), prefill_step=2048)
    preps = {n: vlm_engine.prepare(g) for n, g in gens.items()}
    kept = [batch._keep_points(p.ids, 0, image_span(batch, p.ids)[1]) for p in preps.values()]
    out, first, _ = run(batch, preps, passes)
    together = [p for p in first if p[0] > 1]
    if vlm_engine.vlm.config.model_type == "gemma3":  # (one by one)
        assert not together and len(first) == sum(1 + len(k) for k in kept)
    else:  # one pass for all, two where each keeps its state before its image
        assert len(first) == len(together) == 1 + bool(kept[0])
        assert {p[0] for p in first} == {len(gens)}
    for n in gens:
        assert len(out[n]) == 6 and same(out[n], alone[n]), n
    # The states kept on the way are each row's own: the same words about another image
    # resume from the state before the image (a cache that cannot be trimmed keeps it
    # there; one that can, trims the prompt's end to it), and say what a cold run says.
    for n, text in zip(gens, TEXTS):
        other = ask(rid=f"{n}-other", max_tokens=4, text=text, images=(png(seed=99),))
        prep = vlm_engine.prepare(other)
        image = image_span(batch, prep.ids)[0]
        theirs, cached = one(batch, vlm_engine, other)
        assert cached == image and theirs == one(vbatch(vlm_engine), vlm_engine, other)[0], n


def test_a_burst_with_cached_starts_prefills_as_one_batch_from_nothing(vlm_engine, passes):
    """Served, nearly every image chat starts from a cached state (a template's header,
    the same words before another image): those go in the batch from nothing, the start
    computed again in the pass the batch runs anyway, rather than two passes each; a
    step's prefill bound is as text prompts have it, `prefill_batch` chunks' positions."""
    gens = burst()
    alone = each_alone(vlm_engine, gens)
    batch = vbatch(vlm_engine, PrefixCache(1 << 28))  # (64-token chunks: 4 rows fit in
    # `prefill_batch` chunks' positions, as text prompts do, not in one)
    for n, text in zip(gens, TEXTS):  # (the same words about another image, before)
        one(batch, vlm_engine, ask(rid=f"{n}-before", max_tokens=2, text=text,
                                   images=(png(seed=99),)))
    preps = {n: vlm_engine.prepare(g) for n, g in gens.items()}
    images = [image_span(batch, p.ids)[0] for p in preps.values()]
    out, first, cached = run(batch, preps, passes)
    assert cached == images  # (each one's words were in the cache: reported so)
    if vlm_engine.vlm.config.model_type == "gemma3":  # (one by one, from its start)
        assert first and {p[0] for p in first} == {1}
    else:  # every pass of the images' prefill holds the burst's four rows
        assert first and {p[0] for p in first} == {len(gens)}, first
    for n in gens:
        assert len(out[n]) == 6 and same(out[n], alone[n]), n


def test_a_bucketed_width_gives_each_its_own_tokens(vlm_engine, passes, monkeypatch):
    """On CUDA (mlx_lm_patches.BUCKET) the batch's width is a multiple of BUCKET, every
    row's left padding longer by as much: the same tokens and log-probabilities, and the
    state kept before each image is still the row's own."""
    from worker.loop import mlx_lm_patches

    if vlm_engine.vlm.config.model_type == "gemma3":
        pytest.skip("one by one: no batch width")
    gens = burst(seed=40)
    alone = each_alone(vlm_engine, gens)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 48)
    batch = vbatch(vlm_engine, PrefixCache(1 << 28), prefill_step=2048)
    preps = {n: vlm_engine.prepare(g) for n, g in gens.items()}
    longest = max(image_span(batch, p.ids)[1] for p in preps.values())
    out, first, _ = run(batch, preps, passes)
    assert longest % 48 and sum(p[1] for p in first) == 48 * -(-longest // 48), first
    for n in gens:
        assert len(out[n]) == 6 and same(out[n], alone[n]), n
    for n, text in zip(gens, TEXTS):  # (the state before the image: as in the first test)
        other = ask(rid=f"{n}-other", max_tokens=4, text=text, images=(png(seed=98),))
        theirs, cached = one(batch, vlm_engine, other)
        assert cached and theirs == one(vbatch(vlm_engine), vlm_engine, other)[0], n


def test_a_bursts_images_go_through_the_tower_in_one_call(vlm_engine, passes, monkeypatch):
    """mlx-vlm's own batch runs a group's images through the vision tower at once; so does
    the burst's prefill here, for the families worker/vision/towers.py knows (each
    prompt given its share of the features), with each prompt's own tokens."""
    from worker.vision import towers

    tower = type(vlm_engine.vlm.vision_tower)
    calls = []
    original = tower.__call__

    def counted(self, pixels, *a, **kw):
        calls.append(pixels.shape)
        return original(self, pixels, *a, **kw)

    gens = burst(seed=70)
    alone = each_alone(vlm_engine, gens)
    monkeypatch.setattr(tower, "__call__", counted)
    batch = vbatch(vlm_engine, PrefixCache(1 << 28), prefill_step=2048)
    out, _, _ = run(batch, {n: vlm_engine.prepare(g) for n, g in gens.items()}, passes)
    if vlm_engine.vlm.config.model_type in towers.FAMILIES:
        assert len(calls) == 1, calls
    else:  # (Gemma 3: a tower call a prompt, as before)
        assert len(calls) == len(gens), calls
    for n in gens:
        assert len(out[n]) == 6 and same(out[n], alone[n]), n


def test_text_prompts_and_image_tails_prefill_in_buckets_on_the_language_model(
        vlm_engine, monkeypatch):
    """On CUDA (mlx_lm_patches.BUCKET) the text batch's prompt passes on a vision
    checkpoint's language model are padded to a multiple of BUCKET as a text model's are
    (a text prompt, the words after an image, from its carried state with its position
    delta), where its caches take the padding back (Qwen2-VL's; Qwen3.5's recurrent
    state and the tiny Gemmas' 16-token windows keep mlx-lm's own passes): each request,
    alone and four together, has the tokens and log-probabilities it has unpadded."""
    from tests.worker.test_worker_vision_batch import asks
    from worker.loop import mlx_lm_patches

    gens = asks(logprobs=True)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    alone = each_alone(vlm_engine, gens)
    together = run_all(vbatch(vlm_engine), {n: vlm_engine.prepare(g) for n, g in gens.items()})
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    widths = forward_shapes(monkeypatch, type(vlm_engine.model))
    padded = each_alone(vlm_engine, gens)
    padded_together = run_all(vbatch(vlm_engine),
                              {n: vlm_engine.prepare(g) for n, g in gens.items()})
    passes = [w for w in widths if w[1] > 1]
    if vlm_engine.vlm.config.model_type == "qwen2_vl":
        assert passes and all(w[1] % 16 == 0 for w in passes), passes
    for n in gens:
        assert len(padded[n]) == 8 and same(padded[n], alone[n]), n
        assert same(padded_together[n], together[n]), n


@pytest.mark.parametrize("bound", [None, "tight"])
def test_a_group_runs_as_a_power_of_two_rows_on_cuda(vlm_engine, passes, monkeypatch, bound):
    """On CUDA a group's row count is bucketed too (mlx_lm_patches `bucket_rows`): three
    image chats run as four rows, the last repeated, each real row with its own tokens and
    log-probabilities and its kept state its own; where four rows would pass the step's
    bound on positions, three."""
    from worker.loop import mlx_lm_patches
    from worker.vision import batch as vision_batch

    if vlm_engine.vlm.config.model_type == "gemma3":
        pytest.skip("one by one: no batch width")
    gens = dict(list(burst(seed=60).items())[:3])
    alone = each_alone(vlm_engine, gens)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    if bound:  # (as the batch passes it, but too small for a fourth row)
        monkeypatch.setattr(vision_batch, "Together", lambda lm, jobs, positions: Together(
            lm, jobs, 3 * Together(lm, jobs).width))
    batch = vbatch(vlm_engine, PrefixCache(1 << 28), prefill_step=2048)
    out, first, _ = run(batch, {n: vlm_engine.prepare(g) for n, g in gens.items()}, passes)
    assert first and {rows for rows, _ in first} == {3 if bound else 4}, first
    for n in gens:
        assert len(out[n]) == 6 and same(out[n], alone[n]), n
    for n, text in zip(gens, TEXTS):  # (the state kept before each image: the row's own)
        other = ask(rid=f"{n}-other", max_tokens=4, text=text, images=(png(seed=97),))
        theirs, cached = one(batch, vlm_engine, other)
        assert cached and theirs == one(vbatch(vlm_engine), vlm_engine, other)[0], n
