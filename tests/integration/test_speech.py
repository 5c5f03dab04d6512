"""Speech served end to end (worker/speech/, supervisor/api/audio/): the real supervisor
and speech workers over HTTP with the official openai client, on the tiny random-weight
Whisper and Pocket TTS. Random weights: asserts on structure, formats, limits and
errors, not on words."""

from __future__ import annotations

import concurrent.futures
import io
import os
import signal
import time

import httpx
import numpy as np
import openai
import pytest

from bench.multimodal import tone_wav
from tests.schema import validate
from tests.serverproc import ServerProcess
from worker.media.decode import decode_audio


@pytest.fixture(scope="module")
def sserver(stt_model, tts_model):
    with ServerProcess([str(stt_model), str(tts_model)], "--max-audio-bytes", "20M") as srv:
        srv.wait_healthy(timeout=180)
        yield srv


@pytest.fixture
def sclient(sserver):
    return openai.OpenAI(base_url=f"{sserver.url}/v1", api_key="x", max_retries=0)


def tone(seconds: float, rate: int = 16000, fmt: str = "wav") -> bytes:
    """A real audio file: a wobbling tone, as WAV, or through PyAV as FLAC, MP3, Ogg Opus
    or M4A (AAC)."""
    if fmt == "wav":
        return tone_wav(seconds, rate)
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 300 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)))
    from supervisor.api.audio.encode import Encoder

    if fmt == "m4a":
        import av

        out = io.BytesIO()
        with av.open(out, "w", format="ipod") as c:
            s = c.add_stream("aac", rate=rate)
            s.layout = "mono"
            frame = av.AudioFrame.from_ndarray(x.astype(np.float32).reshape(1, -1),
                                               format="flt", layout="mono")
            frame.sample_rate = rate
            for p in [*s.encode(frame), *s.encode(None)]:
                c.mux(p)
        return out.getvalue()
    enc = Encoder("opus" if fmt == "ogg" else fmt, rate)  # ogg: Opus in Ogg, as browsers record
    return enc.feed(x.astype(np.float32)) + enc.close()


def test_models_list_speech_kinds_capabilities_and_voices(sclient, stt_model, tts_model):
    stt = sclient.models.retrieve(str(stt_model)).model_extra
    tts = sclient.models.retrieve(str(tts_model)).model_extra
    assert stt["kind"] == "stt" and "audio.transcriptions" in stt["capabilities"]
    assert "audio.translations" in stt["capabilities"]
    assert tts["kind"] == "tts" and tts["capabilities"] == ["audio.speech"]
    assert tts["voices"] == ["ash", "birch", "cedar"]
    aliases = tts["voice_aliases"]  # OpenAI's names: its own ash and cedar stay its own
    assert aliases["alloy"] == "ash" and aliases["ballad"] == "birch"
    assert "ash" not in aliases and "cedar" not in aliases and len(aliases) == 11


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg", "m4a"])
def test_transcription_reads_every_common_format(sclient, stt_model, fmt):
    r = sclient.audio.transcriptions.create(model=str(stt_model), language="en",
                                            file=(f"a.{fmt}", tone(4.0, fmt=fmt)))
    validate(r.model_dump(exclude_none=True), "CreateTranscriptionResponseJson", strict=True)
    assert isinstance(r.text, str) and abs(r.usage.seconds - 4.0) < 0.2


def test_transcription_in_every_response_format(sclient, stt_model):
    model, audio = str(stt_model), tone(35.0)
    verbose = sclient.audio.transcriptions.create(
        model=model, file=("a.wav", audio), language="en", response_format="verbose_json",
        timestamp_granularities=["segment"])
    body = verbose.model_dump(exclude_none=True)
    validate(body, "CreateTranscriptionResponseVerboseJson", strict=True)
    assert body["language"] == "english" and abs(body["duration"] - 35.0) < 0.01
    starts = [s["start"] for s in body["segments"]]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] >= 30.0  # 2 windows
    text = sclient.audio.transcriptions.create(model=model, file=("a.wav", audio),
                                               language="en", response_format="text")
    assert text.strip() == verbose.text
    srt = sclient.audio.transcriptions.create(model=model, file=("a.wav", audio),
                                              language="en", response_format="srt")
    vtt = sclient.audio.transcriptions.create(model=model, file=("a.wav", audio),
                                              language="en", response_format="vtt")
    cues = [s for s in body["segments"] if s["text"].strip()]
    assert srt.count(" --> ") == len(cues) and srt.startswith("1\n00:00:00,000 --> ")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.count(" --> ") == len(cues)
    words = sclient.audio.transcriptions.create(
        model=model, file=("a.wav", tone(3.0)), language="en", response_format="verbose_json",
        timestamp_granularities=["word"])
    assert words.words is not None and all(w.end >= w.start for w in words.words)
    translated = sclient.audio.translations.create(model=model, file=("a.wav", tone(3.0)))
    validate(translated.model_dump(exclude_none=True), "CreateTranslationResponseJson",
             strict=True)


def test_streamed_transcription_sends_a_delta_per_window(sclient, stt_model):
    events = list(sclient.audio.transcriptions.create(
        model=str(stt_model), file=("a.wav", tone(65.0)), language="en", stream=True))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    # The worker sends one Delta a 30 s window (three here); the supervisor joins those
    # that arrived before the stream could write the last (a busy machine: the full run
    # at 9abb7d1 saw two events), so one event a window at most, and more than one.
    assert 2 <= len(deltas) <= 3 and events[-1].type == "transcript.text.done"
    assert "".join(d.delta for d in deltas).strip() == events[-1].text


def test_bad_audio_is_a_400_and_an_oversized_file_a_413(sclient, stt_model):
    with pytest.raises(openai.BadRequestError) as e:
        sclient.audio.transcriptions.create(model=str(stt_model),
                                            file=("a.wav", b"RIFF....not audio at all"))
    assert e.value.body["param"] == "file" and "could not be decoded" in e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        sclient.audio.transcriptions.create(model=str(stt_model),
                                            file=("a.wav", b"\0" * (20 * 2**20 + 1)))
    assert e.value.status_code == 413


@pytest.mark.parametrize("fmt", ["mp3", "wav", "flac", "opus", "aac", "pcm"])
def test_speech_bytes_decode_as_audio_of_plausible_length(sclient, tts_model, fmt):
    r = sclient.audio.speech.create(model=str(tts_model), input="Hello there, friend.",
                                    voice="cedar", response_format=fmt)
    data = r.read()
    if fmt == "pcm":
        seconds = len(data) / 2 / 24000
    else:
        seconds = decode_audio(data, 24000).size / 24000
    # The demo speaks (words + 2) s: 5 s, give or take a codec's frame of padding.
    assert 4.8 <= seconds <= 5.2, seconds


def test_speech_streams_before_it_ends_and_an_unknown_voice_lists_the_voices(sclient, tts_model):
    arrivals = []
    t0 = time.monotonic()
    with sclient.audio.speech.with_streaming_response.create(
            model=str(tts_model), input=" ".join(["word"] * 30) + ".", voice="ash",
            response_format="pcm") as r:
        for chunk in r.iter_bytes(4096):
            arrivals.append((time.monotonic() - t0, len(chunk)))
    total = sum(n for _, n in arrivals)
    assert total == int(32 * 12.5) * 1920 * 2  # 32 s of 24 kHz 16-bit audio
    got, half_at = 0, None
    for at, n in arrivals:
        got += n
        if half_at is None and got >= total // 2:
            half_at = at
    assert half_at < arrivals[-1][0]  # streamed: half the audio came before the end
    with pytest.raises(openai.BadRequestError) as e:
        sclient.audio.speech.create(model=str(tts_model), input="Hi", voice="bella")
    assert e.value.body["param"] == "voice" and "ash, birch, cedar" in e.value.message


def test_openai_voice_names_speak_as_the_models_voices(sclient, tts_model):
    """Every OpenAI name is accepted on a model whose voices have other names (the demo's
    ash, birch, cedar), and speaks: the same length of audio as the model's own voice."""
    def speak(voice: str) -> bytes:
        return sclient.audio.speech.create(model=str(tts_model), input="Hi there.",
                                           voice=voice, response_format="pcm").content

    own = len(speak("birch"))
    assert own > 0
    for voice in ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                  "shimmer", "verse", "marin", "cedar"):
        assert len(speak(voice)) == own, voice


def test_a_worker_killed_mid_transcription_fails_cleanly_and_the_next_is_served(
        sserver, sclient, stt_model):
    model = str(stt_model)
    with httpx.Client(base_url=sserver.url, timeout=120) as http:
        before = _worker(sserver, model)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(http.post, "/v1/audio/transcriptions",
                               files={"file": ("a.wav", tone(600.0))},
                               data={"model": model, "language": "en", "stream": "true"})
            _wait(lambda: (_worker(sserver, model).get("progress") or 0) > 0, 60)
            os.kill(before["pid"], signal.SIGKILL)
            r = long.result(timeout=120)
        # Streaming had begun: the stream ends with a clean, retryable error event.
        data = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and 'transcript.text.delta' in data[0]
        assert '"error"' in data[-1] and "worker_failed" in data[-1], data[-1]
        assert "Traceback" not in r.text
    t = sclient.audio.transcriptions.create(model=model, file=("a.wav", tone(2.0)),
                                            language="en")
    assert isinstance(t.text, str)
    after = _worker(sserver, model)
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1


def _worker(srv, model: str) -> dict:
    _, body = srv.get("/health")
    return next(w for w in body["workers"] if w["model"] == model)


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


