"""A vision model's worker engine in-process (worker/vision/): images decoded and
processed on the preparation side, requests run one at a time through mlx-vlm's step
with the text batch's per-sequence output, the same tokens mlx-vlm itself gives."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from protocol.messages import Generate
from tests.generates import generate
from tests.worker.batchrun import Seq
from worker.engine import RequestError


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


def test_a_worker_process_serves_a_vision_model_one_request_at_a_time(spawn, vision_model):
    from protocol.messages import Delta, Done, ModelKind, Ready

    w = spawn(vision_model, "--stream-interval", "0")  # every token its own Delta
    ready = w.wait_for("ready", timeout=120)[0]
    assert isinstance(ready, Ready) and ready.model_kind is ModelKind.VISION and ready.slots == 1
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
    # worker/prompt.py: the worker alone knows its kind for sure (a request can come
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
