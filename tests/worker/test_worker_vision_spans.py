"""Gemma 4's image prompts prefilled in chunks (worker/vision/spans.py) in-process on the
tiny Gemma 4 in the large checkpoints' layout (worker/demos/vision.py `gemma4-31b`),
whose image tokens attend each other both ways: a prompt longer than the
chunk prefills in several chunks, none cutting an image's span, and gives the tokens and
log-probabilities of its one-chunk prefill and of mlx-vlm's own generation (which takes
it whole); an image span longer than the chunk is one chunk of its own."""

from __future__ import annotations

import pytest

from tests.worker.batchrun import Seq
from tests.worker.test_worker_vision import png
from tests.worker.test_worker_vision import run as mlx_vlms  # mlx-vlm's own step, serially
from tests.worker.test_worker_vision_batch import ask, one, same, vbatch
from worker.kvcache.prefix import PrefixCache
from worker.vision.spans import spans


@pytest.fixture(scope="module")
def engines(models_dir):
    """(the batch's engine, mlx-vlm's own one-at-a-time engine) of the tiny Gemma 4 31B."""
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    path = build_vision_model(models_dir / "tiny-vision-gemma4-31b", family="gemma4-31b").path
    vlm, processor = load(str(path))
    assert vlm.language_model.config.use_bidirectional_attention == "vision"
    lm = shared_language_model(vlm, path)
    assert lm is not None
    return VisionEngine(vlm, processor, 4096, 64, lm=lm), VisionEngine(vlm, processor, 4096, 64)


def chunked(engine, gen, prefill_step: int):
    """`gen` alone on a batch of `prefill_step`-token chunks: (its outcomes, the [a, b)
    of each chunk of its image prefill)."""
    batch = vbatch(engine, prefill_step=prefill_step)
    batch.add(Seq("g"), engine.prepare(gen))
    job, cuts, out = batch.prefilling[0], [], []
    while len(batch):
        before = job.pos
        out += [o for _, o in batch.step()]
        if job.pos != before:
            cuts.append((before, job.pos))
    return out, cuts, job


@pytest.mark.parametrize("chunk", [3, 7])
def test_an_image_prompt_prefills_in_chunks_that_keep_each_image_whole(engines, chunk):
    engine, serial = engines
    gen = ask("Here is a long preamble before the pictures, to be prefilled in chunks: "
              "compare them", (png(seed=5), png(120, 80, seed=6)), rid="g", max_tokens=6,
              logprobs=True)
    whole, one_cut, _ = chunked(engine, gen, 4096)
    assert len(one_cut) == 1
    out, cuts, job = chunked(engine, gen, chunk)
    images = job.whole
    assert [e - s for s, e in images] == [4, 2]  # (the tiny processor's image tokens)
    assert len(cuts) > 10 and cuts[0][0] == 0 and cuts[-1][1] == job.end
    assert all(b - a <= chunk for a, b in cuts if (a, b) not in images)
    # Each image in one chunk; one longer than the chunk is a chunk of its own.
    assert all(any(a <= s and e <= b for a, b in cuts) for s, e in images)
    assert all((s, e) in cuts for s, e in images if e - s > chunk)
    assert same(out, whole) and same(out, mlx_vlms(serial, gen))


def test_a_long_preamble_is_reused_before_another_image(engines):
    # Its sliding windows cannot be trimmed: the state before the first image is kept on
    # the way (worker/vision/batch.py `_keep_points`); the next image's prefill then
    # starts after a cached prefix, where the two-way attention within it must hold
    # (spans.install), in chunks that keep it whole.
    engine, serial = engines
    batch = vbatch(engine, PrefixCache(1 << 28), prefill_step=5)
    text = "A long preamble that an agent sends with every request, then a picture:"
    first = ask(text, (png(seed=5),), rid="a", max_tokens=4)
    start = min(i for i, t in enumerate(engine.prepare(first).ids) if t in batch.media_tokens)
    assert one(batch, engine, first)[1] == 0
    other = ask(text, (png(120, 80, seed=6),), rid="b", max_tokens=6, logprobs=True)
    seq, out = Seq("b"), []
    cached = batch.add(seq, engine.prepare(other))
    while len(batch):
        out += [o for _, o in batch.step()]
    assert cached == start > 10
    assert same(out, chunked(engine, other, 4096)[0]) and same(out, mlx_vlms(serial, other))


def test_a_checkpoint_inside_an_image_kept_whole_is_passed_not_waited_for(engines):
    # The KV cache's checkpoints every 3 tokens: some fall inside an image's span, which
    # no chunk may cut; the prefill goes past them (a chunk never ends inside, and never
    # goes back) and keeps the states at the others.
    engine, serial = engines
    batch = vbatch(engine, PrefixCache(1 << 28), prefill_step=5)
    batch.kvcache.every = 3
    gen = ask("A preamble before the pictures: compare them", (png(seed=5), png(seed=6)),
              rid="g", max_tokens=4, logprobs=True)
    batch.add(Seq("g"), engine.prepare(gen))
    job, out = batch.prefilling[0], []
    points = list(job.keep)
    for _ in range(200):
        out += [o for _, o in batch.step()]
        if not len(batch):
            break
    inside = [p for p in points if any(s < p < e for s, e in job.whole)]
    assert inside and not len(batch) and same(out, mlx_vlms(serial, gen))
    assert len(batch.kvcache.prefix) > 3  # (the states at the points outside the images)


def test_the_spans_are_the_runs_of_image_and_video_tokens():
    assert spans([[0, 1, 1, 0, 2, 2, 2, 3, 1]]) == [(1, 3), (4, 7), (8, 9)]
    assert spans([[0, 3, 0]]) == []
