"""The tiny speech model (worker/demos/tts.py) is a real mlx-audio model: mlx-audio's own
loader reads it with no network, each of its voices speaks (random weights: noise, not
words; the structure is what counts), an unknown voice is refused with the list, and it
streams audio in pieces."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

FRAME = 1920  # samples per latent frame: 24000 Hz / 12.5 Hz


@pytest.fixture(scope="module")
def offline():
    """Any attempt to reach the network fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setattr(socket.socket, "connect", refuse)
    patch.setattr(socket, "create_connection", refuse)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def built(tmp_path_factory, offline):
    from worker.demos.tts import build_tts_model

    return build_tts_model(tmp_path_factory.mktemp("tts") / "tiny-tts")


@pytest.fixture(scope="module")
def model(built):
    from mlx_audio.tts.utils import load_model

    return load_model(built.path)


def speak(model, text, voice, seed=0, **kw):
    import mlx.core as mx

    mx.random.seed(seed)  # sampling draws noise: a seed makes the audio reproducible
    return list(model.generate(text, voice=voice, **kw))


def test_the_directory_is_a_pocket_tts_checkpoint(built):
    from worker.demos.text import MARKER

    config = json.loads((built.path / "config.json").read_text())
    meta = json.loads((built.path / MARKER).read_text())
    assert config["model_type"] == "pocket_tts" and meta["family"] == "pocket_tts"
    assert (built.path / "model.safetensors").is_file()
    assert (built.path / "tokenizer.json").is_file()
    on_disk = sorted(p.stem for p in (built.path / "voices").glob("*.safetensors"))
    assert on_disk == sorted(meta["voices"]) == sorted(built.voices) and len(on_disk) >= 2
    assert meta["sample_rate"] == config["mimi"]["sample_rate"] == built.sample_rate
    assert meta["preset"] == "tiny-tts" and meta["seed"] == 0


def test_mlx_audio_loads_it_and_each_voice_speaks(built, model):
    import mlx.core as mx

    assert type(model).__module__.endswith("pocket_tts.pocket_tts")
    assert model.sample_rate == built.sample_rate
    audio = {}
    for voice in built.voices[:2]:
        results = speak(model, "Hello world.", voice)
        assert len(results) == 1  # not streaming: one result, the whole utterance
        r = results[0]
        assert isinstance(r.audio, mx.array) and r.audio.dtype == mx.float32
        assert r.audio.ndim == 1 and r.samples == r.audio.shape[0]
        assert r.sample_rate == built.sample_rate
        a = np.array(r.audio)
        # End of speech never fires: (2 words + 2) s at 12.5 frames a second.
        assert len(a) == int(4 * 12.5) * FRAME
        assert np.isfinite(a).all()
        assert 0.01 < np.sqrt(np.mean(a * a)) and np.abs(a).max() <= 1.0  # audible, unclipped
        audio[voice] = a
    first, second = audio.values()
    assert np.linalg.norm(first - second) > 0.3 * np.linalg.norm(first)  # the voice counts
    again = np.array(speak(model, "Hello world.", built.voices[0])[0].audio)
    assert np.array_equal(again, first)  # same seed, same audio


def test_longer_text_longer_audio_and_the_text_counts(built, model):
    voice = built.voices[0]
    short = np.array(speak(model, "Hello world.", voice)[0].audio)
    other = np.array(speak(model, "Goodbye moon.", voice)[0].audio)
    long = np.array(speak(model, "Hello world, this is a much longer sentence.", voice)[0].audio)
    assert len(long) > len(short) == len(other)
    assert np.linalg.norm(short - other) > 0.3 * np.linalg.norm(short)


def test_an_unknown_voice_is_refused_with_the_list(built, model):
    with pytest.raises(ValueError, match="Available voices") as err:
        speak(model, "Hello world.", "nobody")
    assert all(v in str(err.value) for v in built.voices)


def test_it_streams_the_same_audio_in_pieces(built, model):
    voice = built.voices[1]
    whole = np.array(speak(model, "Hello world.", voice)[0].audio)
    chunks = speak(model, "Hello world.", voice, stream=True, streaming_interval=0.5)
    assert len(chunks) > 2
    assert all(c.is_streaming_chunk for c in chunks)
    assert [c.is_final_chunk for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # Each piece but the last holds the whole frames that first reach 0.5 s.
    assert all(len(c.audio) == 7 * FRAME for c in chunks[:-1])
    assert [c.segment_idx for c in chunks] == list(range(len(chunks)))
    assert np.array_equal(np.concatenate([np.array(c.audio) for c in chunks]), whole)


def test_building_again_reuses_the_directory(built):
    from worker.demos.tts import build_tts_model

    weights = built.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = build_tts_model(built.path, "small", seed=7)  # reused: size and seed ignored
    assert again == built and weights.stat().st_mtime_ns == stamp
    assert [p.name for p in built.path.parent.iterdir()] == [built.path.name]  # no leftovers


def test_the_build_is_seeded(tmp_path, built, offline):
    from worker.demos.tts import build_tts_model

    import mlx.core as mx

    def weights(path: Path):
        return mx.load(str(path / "model.safetensors"))

    same = build_tts_model(tmp_path / "same")
    other = build_tts_model(tmp_path / "other", seed=1)
    key = "flow_lm.flow_net.cond_embed.weight"
    assert mx.array_equal(weights(same.path)[key], weights(built.path)[key]).item()
    assert not mx.array_equal(weights(other.path)[key], weights(built.path)[key]).item()
