"""A vision model's worker engine in-process (worker/vision/): images decoded and
processed on the preparation side, requests run one at a time through mlx-vlm's step
(the path of a checkpoint mlx-lm has no text class for) with the text batch's
per-sequence output, the same tokens mlx-vlm itself gives; a worker process serves the
model on its batch (tests/worker/test_worker_vision_batch.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from protocol.messages import Generate
from tests.generates import generate
from tests.worker.batchrun import Seq
from worker.errors import RequestError


@pytest.fixture(scope="session")
def vision_loaded(vision_model):
    from mlx_vlm import load

    model, processor = load(str(vision_model))
    return model, processor


@pytest.fixture
def vengine(vision_loaded):
    from worker.vision.engine import VisionEngine

    return VisionEngine(*vision_loaded, 4096, 64)


def png(w=40, h=40, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def ask(text="What is this?", images=(png(),), **kw) -> Generate:
    content = [{"type": "text", "text": text}, *({"type": "image"} for _ in images)]
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0.0)
    return generate(rid="v", messages=[{"role": "user", "content": content}],
                    images=tuple(images), **kw)


def run(engine, gen):
    from worker.vision.serial import SerialBatch

    batch = SerialBatch(engine)
    batch.add(Seq("v"), engine.prepare(gen))
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return out


def test_an_image_request_gives_mlx_vlms_own_tokens(vengine, vision_loaded):
    from mlx_vlm import stream_generate

    prep = vengine.prepare(ask())
    text_only = vengine.prepare(ask(images=()))
    # The image's part: <|vision_start|>, 4 image tokens (40×40 → 56×56: 2×2 merged
    # patches), <|vision_end|>.
    assert len(prep.ids) == len(text_only.ids) + 6
    assert prep.media["pixel_values"].shape[0] == 16 and "image_grid_thw" in prep.media
    ours = [o[0] for o in run(vengine, ask())]
    model, processor = vision_loaded
    text = vengine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image"}]}], tokenize=False,
        add_generation_prompt=True)
    theirs = [r.token for r in stream_generate(model, processor, text,
                                               image=[Image.open(io.BytesIO(png()))],
                                               max_tokens=6, temperature=0.0)][:6]
    assert ours == theirs
    assert [o[0] for o in run(vengine, ask(images=(png(seed=1),)))] != ours


def test_stop_strings_logprobs_and_budget_apply_as_in_the_text_batch(vengine):
    plain = run(vengine, ask(max_tokens=8))
    assert len(plain) == 8 and plain[-1][2] is not None
    text = "".join(o[1] for o in plain)
    stop = text[len(text) // 2:][:3]
    stopped = run(vengine, ask(max_tokens=8, stop=[stop]))
    assert stop not in "".join(o[1] for o in stopped) and len(stopped) < 8
    with_lp = run(vengine, ask(max_tokens=3, logprobs=True, top_logprobs=2))
    assert all(o[3].logprob <= 0 and len(o[3].top) == 2 for o in with_lp)


def test_a_json_schema_shapes_an_image_answer(vengine):
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = run(vengine, ask(max_tokens=120, response_format="json_schema", json_schema=schema))
    assert out[-1][2] == "stop"  # the grammar completed
    assert isinstance(json.loads("".join(o[1] for o in out))["ok"], bool)


def test_a_text_only_request_to_a_vision_model_is_served(vengine):
    out = run(vengine, generate(rid="t", messages=[{"role": "user", "content": "Hi"}],
                                max_tokens=4, temperature=0.0))
    assert len(out) == 4


@pytest.mark.parametrize("images, message", [
    ((b"not an image",), "image 1 of the request could not be decoded"),
    ((png(), png()), "place 1 images and 2 were sent"),
])
def test_bad_images_are_the_clients_400(vengine, images, message):
    gen = ask(images=images)
    gen = Generate(**{**{f: getattr(gen, f) for f in gen.__struct_fields__},
                      "messages": [{"role": "user", "content": [
                          {"type": "text", "text": "?"}, {"type": "image"}]}]})
    with pytest.raises(RequestError, match=message) as e:
        vengine.prepare(gen)
    assert e.value.param == "messages"


def test_a_worker_process_serves_a_vision_model_on_its_batch(spawn, vision_model):
    from protocol.messages import Delta, Done, ModelKind, Ready

    w = spawn(vision_model, "--stream-interval", "0")  # every token its own Delta
    ready = w.wait_for("ready", timeout=120)[0]
    assert isinstance(ready, Ready) and ready.model_kind is ModelKind.VISION and ready.slots > 1
    w.send(ask(max_tokens=5))
    w.send(Generate(**{**{f: getattr(ask(), f) for f in Generate.__struct_fields__},
                       "rid": "bad", "images": (b"junk",)}))
    w.send(generate(rid="text", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                    temperature=0.0))
    events = {"v": [], "bad": [], "text": []}
    while sum(isinstance(e, Done) for ev in events.values() for e in ev) < 3:
        msg = w.recv(timeout=30)
        events[msg.rid].append(msg)
    tokens = {rid: sum(e.n_tokens for e in ev if isinstance(e, Delta)) for rid, ev in events.items()}
    assert tokens == {"v": 5, "bad": 0, "text": 3}
    assert sum(isinstance(e, Delta) for e in events["v"]) == 5  # streamed token by token
    assert [e.finish_reason.value for e in events["v"] if isinstance(e, Done)] == ["length"]
    assert any("could not be decoded" in getattr(e, "message", "") for e in events["bad"])


def test_a_text_model_reads_an_earlier_image_as_a_placeholder_and_refuses_one_now(engine):
    # worker/text/prompt.py: the worker alone knows its kind for sure (a request can come
    # before its model loaded), so a text model applies the media rule itself.
    history = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hm?"}]},
               {"role": "assistant", "content": "A cat."}]
    prep = engine.prepare(generate(rid="t", messages=[*history, {"role": "user",
                                                                  "content": "And?"}],
                                   images=(png(),), max_tokens=2))
    text = engine.tokenizer.decode(prep.ids)
    assert "[image]\nHm?" in text and prep.media is None
    with pytest.raises(RequestError, match="cannot read images") as e:
        engine.prepare(generate(rid="t", messages=history[:1], images=(png(),), max_tokens=2))
    assert e.value.param == "messages[0].content"


# Pixel bounds (worker/vision/images.py): from what the processor keeps, checked on the
# headers before any pixel is decoded.

def one_bit_png(w, h) -> bytes:
    """A blank one-bit PNG: a few KB however many pixels (13,000² is 20 KB)."""
    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("side, per_image", [
    (112, 4096 * 4096),      # the demo's 112²: 64 × 112² is under the floor
    (896, 64 * 896 * 896),   # 64 × side², between the floor and the ceiling
    (3584, 8192 * 8192),     # Qwen2-VL's 12.8 M pixels: capped at the ceiling
    (None, 8192 * 8192),     # a processor that names no size: the ceiling
])
def test_the_bounds_follow_the_kept_side_between_a_floor_and_a_ceiling(side, per_image):
    from worker.vision.images import Limits

    limits = Limits.for_side(side)
    assert (limits.side, limits.per_image, limits.per_request) == (side, per_image, 4 * per_image)


def test_the_kept_side_is_read_from_each_family_of_processor_config(vision_loaded):
    from types import SimpleNamespace as NS

    from transformers import Qwen2VLImageProcessor

    from worker.vision.images import Limits, kept_side

    assert kept_side(vision_loaded[1].image_processor) == 112  # mlx-vlm's: max_pixels 112²
    assert Limits.of(vision_loaded[1].image_processor) == Limits.for_side(112)
    # transformers' Qwen2-VL: size.longest_edge is max_pixels (1,003,520), an area
    assert kept_side(Qwen2VLImageProcessor()) == 1001
    clip = NS(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    assert kept_side(clip) == 336
    assert kept_side(NS(size={"height": 896, "width": 896})) == 896            # Gemma 3
    assert kept_side(NS(size={"longest_edge": 1456, "shortest_edge": 10})) == 1456
    assert kept_side(NS(size={"shortest_edge": 336}, image_grid_pinpoints=[[336, 1008]])) == 1008
    assert kept_side(NS(size={"height": 560, "width": 560}, max_image_tiles=4)) == 2240
    assert kept_side(NS()) is None and kept_side(None) is None


def test_an_image_over_the_bound_is_refused_from_its_header_naming_it_and_both_sizes(vengine):
    bomb = one_bit_png(13000, 13000)  # 169 M pixels in 20 KB
    assert len(bomb) < 64 << 10
    with pytest.raises(RequestError) as e:
        vengine.prepare(ask(images=(png(), bomb)))
    assert "image 2 of the request is 13000x13000 = 169,000,000 pixels" in e.value.message
    assert "bound of 16,777,216 pixels per image" in e.value.message
    assert e.value.param == "messages"


def test_a_request_over_the_bound_together_is_refused_before_any_decode(vengine, monkeypatch):
    from worker.vision import images

    monkeypatch.setattr(images, "decode", lambda *a: pytest.fail("decoded"))
    five = (one_bit_png(4096, 4096),) * 5  # each at the per-image bound
    with pytest.raises(RequestError, match=r"the request's 5 images hold 83,886,080 pixels "
                                           r"together, over this model's bound of "
                                           r"67,108,864 pixels per request"):
        vengine.prepare(ask(images=five))


@pytest.mark.parametrize("fmt, decoded", [("JPEG", (250, 188)),   # drafted at 1/8
                                          ("PNG", (154, 116))])  # reduced by 13
def test_a_large_image_is_decoded_no_larger_than_the_processor_keeps(vengine, fmt, decoded):
    from worker.vision.images import Limits, decode_images

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray((rng.random((1500, 2000, 3)) * 255).astype("uint8")).save(buf, format=fmt)
    assert decode_images((buf.getvalue(),), vengine.limits)[0].size == decoded
    # The processor then gives what it gives from the whole image: the same tokens, the
    # same patch grid.
    small = vengine.prepare(ask(images=(buf.getvalue(),)))
    vengine.limits = Limits(None, vengine.limits.per_image, vengine.limits.per_request)
    whole = vengine.prepare(ask(images=(buf.getvalue(),)))
    assert small.ids == whole.ids
    assert (small.media["image_grid_thw"] == whole.media["image_grid_thw"]).all()
