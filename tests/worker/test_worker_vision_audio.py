"""Audio inputs of a model whose mlx-vlm class hears them (worker/vision/audio.py), in-process
on the tiny Gemma 4 (its audio tower): a request with a clip runs on the continuous batch
beside text and image requests and gets mlx-vlm's own tokens for it; the prefix cache
knows a clip by its bytes; a clip the model cannot take is a 400; a model that hears
nothing (the tiny Qwen2-VL, a text model) refuses an audio part as it refuses an image
it cannot see."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from protocol.messages import INVALID_REQUEST
from tests.generates import generate
from tests.worker.batchrun import run_all
from tests.worker.test_worker_vision import png, vengine, vision_loaded  # noqa: F401 (fixtures)
from tests.worker.test_worker_vision import run as mlx_vlms  # mlx-vlm's own step, serially
from tests.worker.test_worker_vision_batch import one, same, tokens, vbatch
from worker.errors import RequestError
from worker.kvcache.prefix import PrefixCache


def wav(seconds: float = 0.3, freq: float = 440.0, rate: int = 22_050) -> bytes:
    """A tone as a 16-bit WAV file (at another rate than the model's 16 kHz: resampled)."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * freq * t) * 0.3 * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def ask(text: str, audios=(), images=(), rid: str = "a", **kw):
    content = [{"type": "text", "text": text}, *({"type": "image"} for _ in images),
               *({"type": "audio"} for _ in audios)]
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 6)
    return generate(rid=rid, messages=[{"role": "user", "content": content}],
                    images=tuple(images), audios=tuple(audios), **kw)


@pytest.fixture(scope="module")
def gemma4(models_dir):
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model

    path = build_vision_model(models_dir / "tiny-vision-gemma4", family="gemma4").path
    return (*load(str(path)), path)


@pytest.fixture(scope="module")
def engines(gemma4):
    """(the batch's engine, mlx-vlm's own one-at-a-time engine) of the tiny Gemma 4."""
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    lm = shared_language_model(gemma4[0], gemma4[2])
    assert lm is not None
    return VisionEngine(*gemma4[:2], 4096, 64, lm=lm), VisionEngine(*gemma4[:2], 4096, 64)


def test_a_request_with_audio_runs_on_the_batch_and_gives_mlx_vlms_tokens(engines):
    engine, serial = engines
    assert engine.hearing is not None and engine.hearing.rate == 16_000
    gens = {"audio": ask("What is said?", (wav(),), rid="audio", logprobs=True),
            "both": ask("And here?", (wav(0.2, 660.0),), (png(seed=1),), rid="both",
                        logprobs=True),
            "text": ask("Hello there, how are you", rid="text", logprobs=True)}
    prep = engine.prepare(gens["audio"])
    audio_id = engine.vlm.config.audio_token_id
    assert prep.ids.count(audio_id) == 8  # (0.3 s: one token per 40 ms)
    mixed = run_all(vbatch(engine), {n: engine.prepare(g) for n, g in gens.items()})
    for name, gen in gens.items():
        assert same(mixed[name], mlx_vlms(serial, gen)), name
    # What the clip says reaches the model: another tone, other tokens.
    other = run_all(vbatch(engine), {"o": engine.prepare(
        ask("What is said?", (wav(freq=880.0),), rid="o"))})["o"]
    assert tokens(other) != tokens(mixed["audio"])


def test_the_prefix_cache_knows_a_clip_by_its_content(engines):
    engine = engines[0]
    batch = vbatch(engine, PrefixCache(1 << 28))
    first = ask("What is said?", (wav(),), rid="1", max_tokens=4)
    ids = engine.prepare(first).ids
    audio_id = engine.vlm.config.audio_token_id
    start, end = ids.index(audio_id), len(ids) - ids[::-1].index(audio_id)
    cold, cached = one(batch, engine, first)
    assert cached == 0
    again, cached = one(batch, engine, first)  # the same words and clip
    assert again == cold and cached >= end
    # The same words (and as many audio tokens) about another clip: no reuse past it.
    other = ask("What is said?", (wav(freq=880.0),), rid="2", max_tokens=4)
    assert len(engine.prepare(other).ids) == len(ids)
    theirs, cached = one(batch, engine, other)
    assert cached <= start
    assert theirs == one(vbatch(engine), engine, other)[0]


@pytest.mark.parametrize("clip, says", [(wav(3.0), "longer than this model's 2.56 s"),
                                        (b"RIFF not a wave", "could not be decoded")])
def test_a_clip_the_model_cannot_take_is_a_400(engines, clip, says):
    with pytest.raises(RequestError, match=says) as e:
        engines[0].prepare(ask("What is said?", (clip,)))
    assert e.value.code == INVALID_REQUEST and e.value.param == "messages"


def test_a_model_that_hears_nothing_refuses_audio_now_and_placeholds_it_earlier(vengine):
    assert vengine.hearing is None  # (Qwen2-VL: no audio tower)
    with pytest.raises(RequestError, match="cannot read audio") as e:
        vengine.prepare(ask("What is said?", (wav(),)))
    assert e.value.param == "messages[0].content"
    history = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hm?"}]},
               {"role": "assistant", "content": "A tone."},
               {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                            {"type": "image"}]}]
    prep = vengine.prepare(generate(rid="h", messages=history, audios=(wav(),),
                                    images=(png(),), max_tokens=2, temperature=0.0))
    assert "[audio]\nHm?" in vengine.tokenizer.decode(prep.ids)


def test_a_text_model_refuses_audio_as_it_refuses_images(engine):
    with pytest.raises(RequestError, match="cannot read audio") as e:
        engine.prepare(ask("What is said?", (wav(),)))
    assert e.value.param == "messages[0].content"


def test_the_warm_up_runs_the_audio_tower_before_ready(engines, monkeypatch):
    engine = engines[0]
    tower, runs = type(engine.vlm.audio_tower), []
    original = tower.__call__

    def counted(self, *a, **kw):
        runs.append(1)
        return original(self, *a, **kw)

    monkeypatch.setattr(tower, "__call__", counted)
    vbatch(engine).warm()
    assert runs == [1]


def test_a_worker_reports_hearing_and_takes_audio_over_the_protocol(spawn, gemma4):
    from protocol.messages import Delta, Done, Ready

    w = spawn(gemma4[2])
    ready = w.wait_for("ready", timeout=120)[0]
    assert isinstance(ready, Ready) and ready.hears_audio and ready.slots > 1
    w.send(ask("What is said?", (wav(),), rid="heard", max_tokens=3))
    events = []
    while not any(isinstance(e, Done) for e in events):
        events.append(w.recv(timeout=30))
    assert sum(e.n_tokens for e in events if isinstance(e, Delta)) == 3
