"""--kv-bits on a vision-language checkpoint's batch (worker/vision/batch.py `_carry`
between mlx-vlm's full-precision caches, which an image's prefill runs on, and the
batch's quantized ones): tiny Qwen2-VL, Qwen3.5 (its recurrent layers at full precision),
Gemma 3, Gemma 4 (whose last layers read an earlier layer's packed keys:
worker/kvcache/attention.py `_shared_kv`) and the large Gemma 4's layout (an image's
tokens attending each other both ways, keys doubling as values) with heads of 32 (worker/demos/vision.py
`tiny-kvq`), at 8 bits: text and image requests batched equal each alone in the same
format and move off full precision; the same words about another image, and the next turn
about an image, resume from the quantized prefix cache with the cold run's tokens; a
worker starts with it."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import QuantizedKVCache

from tests.worker.batchrun import Seq, run_all
from tests.worker.test_worker_kv_quant import Q8, worker_args
from tests.worker.test_worker_vision import png
from tests.worker.test_worker_vision_batch import ask, asks, tokens
from worker.kvcache.prefix import PrefixCache


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen3.5", "gemma3", "gemma4", "gemma4-31b"])
def engine(request, models_dir):
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    path = build_vision_model(models_dir / f"tiny-kvq-vision-{request.param}", "tiny-kvq",
                              family=request.param).path
    vlm, processor = load(str(path))
    lm = shared_language_model(vlm, path)
    assert lm is not None
    engine = VisionEngine(vlm, processor, 4096, 64, lm=lm)
    engine.path = path
    return engine


def qbatch(engine, prefix=None, fmt=Q8):
    from tests.worker.test_worker_vision_batch import vbatch

    batch = vbatch(engine, prefix)
    batch.kv_format = fmt
    return batch


def one(batch, engine, gen):
    seq, out = Seq(gen.rid), []
    cached = batch.add(seq, engine.prepare(gen))
    while len(batch):
        out += [o for _, o in batch.step()]
    return [o[0] for o in out], [o[3].logprob for o in out if o[3] is not None], cached


def test_text_and_image_requests_batch_as_alone_on_a_quantized_cache(engine):
    from worker.kvcache.quantized import KVFormat

    gens = asks(logprobs=True)
    alone = {n: tokens(run_all(qbatch(engine), {n: engine.prepare(g)})[n])
             for n, g in gens.items()}
    mixed = run_all(qbatch(engine), {n: engine.prepare(g) for n, g in gens.items()},
                    join={"joins": 3})
    assert {n: tokens(o) for n, o in mixed.items()} == alone
    assert any(isinstance(c, QuantizedKVCache) for c in Q8.make(engine.model))
    full = one(qbatch(engine, fmt=KVFormat()), engine, gens["image"])[1]
    assert one(qbatch(engine), engine, gens["image"])[1] != full  # (the format in effect)


def test_a_quantized_prefix_serves_another_image_and_the_next_turn(engine):
    batch = qbatch(engine, PrefixCache(1 << 28))
    text = "A preamble the client sends each time, about this picture:"
    first = ask(text, (png(seed=1),), rid="a", max_tokens=4)
    start = min(i for i, t in enumerate(engine.prepare(first).ids) if t in batch.media_tokens)
    said, _, cached = one(batch, engine, first)
    assert cached == 0
    other = ask(text, (png(seed=2),), rid="b", max_tokens=4)
    out, _, cached = one(batch, engine, other)
    assert cached == start and out == one(qbatch(engine), engine, other)[0]
    turn2 = ask(text, (png(seed=1),), rid="c", max_tokens=4)
    turn2.messages.extend([{"role": "assistant", "content": engine.tokenizer.decode(said)},
                           {"role": "user", "content": "And then?"}])
    out, _, cached = one(batch, engine, turn2)
    ids = engine.prepare(turn2).ids
    assert cached > 1 + max(i for i, t in enumerate(ids) if t in batch.media_tokens)
    assert out == one(qbatch(engine), engine, turn2)[0]


def test_a_vision_worker_loads_with_kv_bits(engine, tmp_path):
    from worker.loading.startup import make_batch
    from worker.vision.batch import VisionBatch

    batch = make_batch(engine, worker_args(tmp_path, "--kv-bits", "8", "--kv-group-size",
                                           "32"), engine.path, cls=VisionBatch)
    assert batch.kv_format.bits == 8
    out, _, _ = one(batch, engine, ask("Look", (png(seed=3),), rid="w", max_tokens=3))
    assert len(out) == 3
