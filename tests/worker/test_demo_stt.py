"""The tiny Whisper (worker/demos/stt.py) is a real mlx-audio Whisper: mlx-audio's own
loader reads it, with its Hugging Face processor, as a multilingual model; it transcribes
audio into short text with segments and timestamps, window by window (random weights:
the words mean nothing; the structure is what counts)."""

from __future__ import annotations

import json

import numpy as np
import pytest

SR = 16000


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    """Tones that come and go over noise: 16 kHz float32 mono."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    tones = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 3000, 3))
    return (0.1 * tones * (np.sin(2 * np.pi * 0.5 * t) > 0)
            + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def stt_model(tmp_path_factory):
    from worker.demos.stt import build_stt_model

    return build_stt_model(tmp_path_factory.mktemp("stt") / "tiny-stt")


@pytest.fixture(scope="module")
def whisper(stt_model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing is fetched
        from mlx_audio.stt.utils import load_model

        yield load_model(str(stt_model.path))


def check_segments(result, duration: float) -> None:
    assert isinstance(result.text, str)
    assert result.segments
    previous_end = 0.0
    for s in result.segments:
        assert previous_end <= s["start"] < s["end"] <= duration + 1e-6
        previous_end = s["end"]
        assert s["temperature"] == 0.0  # greedy was good enough: no fallback
    assert result.text == "".join(s["text"] for s in result.segments)


def test_mlx_audio_loads_it_as_multilingual_whisper_with_its_processor(stt_model, whisper):
    from mlx_audio.stt.models.whisper.whisper import Model

    config = json.loads((stt_model.path / "config.json").read_text())
    assert isinstance(whisper, Model) and config["model_type"] == "whisper"
    assert stt_model.vocab_size == config["n_vocab"] == whisper.dims.n_vocab == 51865
    assert type(whisper._processor).__name__ == "WhisperProcessor"
    assert whisper._processor.feature_extractor.feature_size == whisper.dims.n_mels
    assert whisper.is_multilingual and whisper.num_languages == 99
    tok = whisper.get_tokenizer(language="fr", task="translate")
    # Whisper's own ids, which mlx-audio's decoding rules depend on.
    assert (tok.eot, tok.sot, tok.translate, tok.transcribe, tok.sot_prev, tok.no_speech,
            tok.no_timestamps, tok.timestamp_begin) == (
        50257, 50258, 50358, 50359, 50361, 50362, 50363, 50364)
    assert tok.sot_sequence == (50258, 50265, 50358)  # <|fr|> is the 7th language
    assert len(tok.all_language_tokens) == 99
    assert tok.hf_tokenizer.convert_tokens_to_ids("<|30.00|>") == 51864
    text = "Hello, world!"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < tok.eot


def test_a_short_clip_becomes_short_text_in_one_timed_segment(whisper):
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    result = whisper.generate(clip(5), return_timestamps=True)
    check_segments(result, 5.0)
    assert 0 < len(result.text.strip()) and len(result.segments[0]["tokens"]) <= 12
    assert result.segments[0]["tokens"][0] == 50364  # opens with <|0.00|>
    assert result.language in list(LANGUAGES)[:99]  # detected: no language was given
    assert whisper.generate(clip(5)).text == result.text  # greedy: same clip, same text


def test_language_and_task_are_given_to_the_model(whisper):
    audio = clip(5, seed=1)
    results = {(lang, task): whisper.generate(audio, language=lang, task=task)
               for lang in ("fr", "de") for task in ("transcribe", "translate")}
    for (lang, _), result in results.items():
        check_segments(result, 5.0)
        assert result.language == lang
    assert len({r.text for r in results.values()}) > 1  # the prompt's tokens reach the model


def test_the_audio_reaches_the_text(whisper):
    texts = {whisper.generate(clip(30, seed), language="en").text for seed in range(4)}
    assert len(texts) > 1


def test_a_long_clip_runs_through_several_windows(whisper):
    result = whisper.generate(clip(65, seed=2), language="en")
    check_segments(result, 65.0)
    assert [s["start"] for s in result.segments] == [0.0, 30.0, 60.0]  # one per window
    assert result.segments[-1]["end"] == pytest.approx(65.0)


def test_word_timestamps_lie_within_the_audio(whisper):
    result = whisper.generate(clip(5), language="en", word_timestamps=True)
    words = [w for s in result.segments for w in s["words"]]
    assert words and all(0.0 <= w["start"] <= w["end"] <= 5.0 for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)


def test_a_built_model_is_reused(stt_model):
    from worker.demos.stt import build_stt_model

    weights = stt_model.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = build_stt_model(stt_model.path, seed=7)  # already there: not rebuilt
    assert again == stt_model and weights.stat().st_mtime_ns == stamp
