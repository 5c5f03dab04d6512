"""Speech workers (worker/speech/) in real processes: a TTS model's audio streamed piece by
piece, an STT model's text window by window with its Transcript, refusals that are the
client's 400, cancel between pieces, and a kind's wrong task refused."""

from __future__ import annotations

import numpy as np

from bench.multimodal import tone_wav as wav
from protocol.messages import (Audio, Cancel, Delta, Done, Error, Generate, ModelKind, Ready,
                               SpeechSpec, Task, Transcript)


def speak(rid: str, text: str, **spec) -> Generate:
    return Generate(rid=rid, task=Task.SPEAK, prompt=text, speech=SpeechSpec(**spec))


def transcribe(rid: str, audio: bytes, **spec) -> Generate:
    return Generate(rid=rid, task=Task.TRANSCRIBE, audio=audio, speech=SpeechSpec(**spec))


def collect(w, rids, timeout=60):
    events = {rid: [] for rid in rids}
    while sum(isinstance(e, Done) for ev in events.values() for e in ev) < len(rids):
        msg = w.recv(timeout=timeout)
        events[msg.rid].append(msg)
    return events


def done(events) -> Done:
    return next(e for e in events if isinstance(e, Done))


def test_a_tts_worker_streams_audio_and_refuses_what_it_cannot_do(spawn, tts_model):
    w = spawn(tts_model)
    ready = w.wait_for("ready", timeout=120)[0]
    assert isinstance(ready, Ready) and ready.model_kind is ModelKind.TTS
    assert ready.voices == ["ash", "birch", "cedar"] and ready.sample_rate == 24000
    w.send(speak("a", "Hello there, how are you today?", voice="birch"))
    w.send(speak("bad-voice", "Hi", voice="alloy"))
    w.send(speak("bad-speed", "Hi", speed=2.0))
    w.send(Generate(rid="chat", messages=[{"role": "user", "content": "Hi"}]))
    events = collect(w, ["a", "bad-voice", "bad-speed", "chat"])
    audio = [e for e in events["a"] if isinstance(e, Audio)]
    assert len(audio) >= 2  # streamed: pieces as they are synthesised
    samples = np.concatenate([np.frombuffer(a.data, "<f4") for a in audio])
    assert {a.sample_rate for a in audio} == {24000}
    # The demo speaks (words + 2) s for a sentence (worker/demos/tts.py).
    assert samples.size == 8 * 24000 and np.isfinite(samples).all() and np.abs(samples).max() > 0
    assert done(events["a"]).finish_reason == "stop"
    assert done(events["a"]).completion_tokens == len(audio)
    for rid, param, words in (("bad-voice", "voice", "ash, birch, cedar"),
                              ("bad-speed", "speed", "one speed"),
                              ("chat", "model", "text-to-speech model")):
        err = next(e for e in events[rid] if isinstance(e, Error))
        assert err.param == param and words in err.message, err
        assert done(events[rid]).finish_reason == "error"


def test_a_cancel_stops_a_synthesis_between_pieces(spawn, tts_model):
    w = spawn(tts_model)
    w.wait_for("ready", timeout=120)
    long_text = " ".join(["word"] * 40) + "."
    w.send(speak("long", long_text))
    first = w.recv(timeout=60)
    while not isinstance(first, Audio):
        first = w.recv(timeout=60)
    w.send(Cancel(rid="long"))
    w.send(speak("next", "Hi."))
    events = collect(w, ["long", "next"])
    heard = 1 + sum(isinstance(e, Audio) for e in events["long"])
    assert done(events["long"]).finish_reason == "cancelled"
    assert heard * 13440 < 42 * 24000  # far less than the whole utterance
    assert done(events["next"]).finish_reason == "stop"
    assert sum(np.frombuffer(e.data, "<f4").size for e in events["next"]
               if isinstance(e, Audio)) == int(3 * 12.5) * 1920  # 3 s in whole frames


def test_an_stt_worker_streams_windows_then_the_transcript(spawn, stt_model):
    w = spawn(stt_model)
    ready = w.wait_for("ready", timeout=120)[0]
    assert ready.model_kind is ModelKind.STT and ready.translates and ready.sample_rate == 16000
    w.send(transcribe("long", wav(65.0), language="en", segments=True))
    w.send(transcribe("fr", wav(5.0), language="fr", translate=True))
    w.send(transcribe("junk", b"RIFF not really a wave file"))
    w.send(transcribe("lang", wav(2.0), language="xx"))
    w.send(speak("speak", "Hi"))
    events = collect(w, ["long", "fr", "junk", "lang", "speak"], timeout=120)
    deltas = [e.text for e in events["long"] if isinstance(e, Delta)]
    t = next(e for e in events["long"] if isinstance(e, Transcript))
    # Whisper's 30-s windows, each streamed as it is committed: 0-30, 30-60, 60-65.
    assert len(deltas) == 3 and len(t.segments) == 3
    assert [round(s.start) for s in t.segments] == [0, 30, 60]
    assert abs(t.duration - 65.0) < 0.01 and t.language == "english"
    assert "".join(deltas).strip() == t.text == "".join(s.text for s in t.segments).strip()
    assert done(events["long"]).finish_reason == "stop"
    fr = next(e for e in events["fr"] if isinstance(e, Transcript))
    assert fr.language == "french" and fr.segments == []  # not asked for
    for rid, param, words in (("junk", "file", "could not be decoded"),
                              ("lang", "language", "Unknown language"),
                              ("speak", "model", "speech recognition model")):
        err = next(e for e in events[rid] if isinstance(e, Error))
        assert err.param == param and words in err.message, err
        assert done(events[rid]).finish_reason == "error"


def test_a_cancel_stops_a_transcription_between_windows(spawn, stt_model):
    w = spawn(stt_model)
    w.wait_for("ready", timeout=120)
    w.send(transcribe("long", wav(600.0), language="en"))
    while not isinstance(w.recv(timeout=60), Delta):
        pass
    w.send(Cancel(rid="long"))
    w.send(transcribe("next", wav(3.0), language="en"))
    events = collect(w, ["long", "next"])
    windows = 1 + sum(isinstance(e, Delta) for e in events["long"])
    assert done(events["long"]).finish_reason == "cancelled"
    assert windows < 20  # of the 600 s's 20 windows
    assert not any(isinstance(e, Transcript) for e in events["long"])
    assert any(isinstance(e, Transcript) for e in events["next"])
