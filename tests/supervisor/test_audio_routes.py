"""/v1/audio/transcriptions, /translations and /speech over HTTP against the fake worker:
the multipart form and its limits, every response format (shapes validated against
OpenAI's spec), streaming events, the task a model's kind cannot do, the guard for
uploads from other sites, and synthesised audio encoded as asked."""

from __future__ import annotations

import base64
import json
import re

import aiohttp
import numpy as np
import pytest

from protocol import Generate, ModelKind, Task
from supervisor.api.audio.encode import PCM_RATE
from supervisor.api.audio.voices import OPENAI_VOICES, aliases, resolve
from tests.schema import spec, validate
from tests.supervisor.fakes import FAKE_RATE, FakeBehaviour, FakeWorld
from tests.supervisor.test_app import client_for
from worker.media.decode import decode_audio

AUDIO = b"\x00" * 3000  # the fake worker never decodes it: its duration is len / 1000


async def _client(kind: ModelKind, **cfg):
    world = FakeWorld(FakeBehaviour(model_kind=kind))
    return world, await client_for(world, **cfg)


def _form(**fields) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("file", fields.pop("file", AUDIO), filename="a.wav",
                   content_type="audio/wav")
    fields.setdefault("model", "fake")
    for name, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            form.add_field(name, v)
    return form


def _sent(world: FakeWorld) -> Generate:
    return [m for m in world.received if isinstance(m, Generate)][-1]


async def _error(resp, status: int, param: str | None = None) -> dict:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def test_transcription_json_text_and_the_generate_it_sends():
    world, client = await _client(ModelKind.STT)
    try:
        r = await client.post("/v1/audio/transcriptions", data=_form(
            language="FR", prompt="Vocabulaire", temperature="0.2"))
        body = await r.json()
        assert r.status == 200, body
        validate(body, "CreateTranscriptionResponseJson", strict=True)
        assert body["text"] == "w1 w2 w3 w4 w5"
        assert body["usage"] == {"type": "duration", "seconds": 3.0}
        g = _sent(world)
        assert g.task is Task.TRANSCRIBE and g.audio == AUDIO and g.prompt == "Vocabulaire"
        assert g.speech.language == "fr" and not g.speech.translate
        assert g.sampling.temperature == 0.2 and not g.speech.segments
        r = await client.post("/v1/audio/transcriptions", data=_form(response_format="text"))
        assert r.status == 200 and r.content_type == "text/plain"
        assert await r.text() == "w1 w2 w3 w4 w5\n"
    finally:
        await client.close()


async def test_verbose_json_with_segments_and_words_and_subtitles():
    world, client = await _client(ModelKind.STT)
    try:
        r = await client.post("/v1/audio/transcriptions", data=_form(
            response_format="verbose_json",
            **{"timestamp_granularities[]": ["word", "segment"]}))
        body = await r.json()
        assert r.status == 200, body
        validate(body, "CreateTranscriptionResponseVerboseJson", strict=True)
        assert body["language"] == "english" and body["duration"] == 3.0
        assert [s["id"] for s in body["segments"]] == [0, 1, 2, 3, 4]
        assert body["segments"][1]["start"] == 1.0 and body["segments"][1]["tokens"] == [2]
        assert body["words"] == []  # the fake times no words; the key is there as asked
        g = _sent(world)
        assert g.speech.segments and g.speech.words
        r = await client.post("/v1/audio/transcriptions", data=_form(response_format="srt"))
        srt = await r.text()
        assert srt.startswith("1\n00:00:00,000 --> 00:00:01,000\nw1\n\n2\n")
        assert srt.count(" --> ") == 5
        r = await client.post("/v1/audio/transcriptions", data=_form(response_format="vtt"))
        vtt = await r.text()
        assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nw1\n")
        r = await client.post("/v1/audio/transcriptions", data=_form(
            response_format="verbose_json"))
        body = await r.json()
        assert "segments" in body and "words" not in body and not _sent(world).speech.words
    finally:
        await client.close()


async def test_streamed_transcription_sends_deltas_then_done():
    world, client = await _client(ModelKind.STT)
    try:
        r = await client.post("/v1/audio/transcriptions", data=_form(stream="true"))
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "transcript.text.delta"]
        for e in deltas:
            validate(e, "TranscriptTextDeltaEvent", strict=True)
        assert len(deltas) >= 1 and "".join(e["delta"] for e in deltas) == " w1 w2 w3 w4 w5"
        assert events[-1] == {"type": "transcript.text.done", "text": "w1 w2 w3 w4 w5"}
        validate(events[-1], "TranscriptTextDoneEvent", strict=True)
    finally:
        await client.close()


async def test_translation_asks_the_worker_to_translate_and_answers_in_english():
    world, client = await _client(ModelKind.STT)
    try:
        r = await client.post("/v1/audio/translations", data=_form(
            response_format="verbose_json", language="de"))
        body = await r.json()
        assert r.status == 200, body
        validate(body, "CreateTranslationResponseVerboseJson", strict=True)
        assert body["language"] == "english"
        g = _sent(world)
        assert g.speech.translate and g.speech.language is None  # translations take none
    finally:
        await client.close()


@pytest.mark.parametrize("fields,param", [
    ({"model": ""}, "model"),
    ({"response_format": "diarized_json"}, "response_format"),
    ({"temperature": "1.5"}, "temperature"),
    ({"temperature": "warm"}, "temperature"),
    ({"timestamp_granularities[]": "word"}, "timestamp_granularities"),
    ({"response_format": "verbose_json", "timestamp_granularities[]": "char"},
     "timestamp_granularities"),
    ({"stream": "true", "response_format": "srt"}, "stream"),
    ({"stream": "maybe"}, "stream"),
    ({"language": "english!"}, "language"),
    ({"include[]": "logprobs"}, "include"),
    ({"chunking_strategy": '{"type": "server_vad"}'}, "chunking_strategy"),
])
async def test_bad_forms_are_400s_naming_the_param(fields, param):
    world, client = await _client(ModelKind.STT)
    try:
        await _error(await client.post("/v1/audio/transcriptions", data=_form(**fields)),
                     400, param)
    finally:
        await client.close()


async def test_missing_file_too_large_file_and_wrong_content_type():
    world, client = await _client(ModelKind.STT, max_audio_bytes=10_000)
    try:
        form = aiohttp.FormData(default_to_multipart=True)
        form.add_field("model", "fake")
        form.add_field("prompt", "no file")
        await _error(await client.post("/v1/audio/transcriptions", data=form), 400, "file")
        err = await _error(await client.post("/v1/audio/transcriptions", data=_form(
            file=b"\x00" * 10_001)), 413, "file")
        assert "10000 bytes" in err["message"]
        r = await client.post("/v1/audio/transcriptions", json={"model": "fake"})
        assert r.status == 415, await r.text()
        assert not [m for m in world.received if isinstance(m, Generate)][1:]
    finally:
        await client.close()


async def test_uploads_from_another_sites_page_are_refused():
    world, client = await _client(ModelKind.STT)
    try:
        r = await client.post("/v1/audio/transcriptions", data=_form(),
                              headers={"Origin": "https://evil.example"})
        err = await _error(r, 403)
        assert "Origin" in err["message"]
        host = f"{client.server.host}:{client.server.port}"
        r = await client.post("/v1/audio/transcriptions", data=_form(),
                              headers={"Origin": f"http://{host}", "Host": host})
        assert r.status == 200, await r.text()
        # Every other POST still needs JSON: the form exemption is the upload routes'.
        r = await client.post("/v1/audio/speech", data=_form())
        assert r.status == 415
    finally:
        await client.close()


async def test_a_task_the_model_cannot_do_is_refused_naming_the_model():
    world, client = await _client(ModelKind.TEXT)
    try:
        await client.get("/v1/models")
        err = await _error(await client.post("/v1/audio/transcriptions", data=_form()), 400,
                           "model")
        assert "cannot transcribe audio" in err["message"]
        err = await _error(await client.post("/v1/audio/speech", json={
            "model": "fake", "input": "hi", "voice": "fable"}), 400, "model")
        assert "cannot synthesise speech" in err["message"]
    finally:
        await client.close()


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac"])
async def test_speech_in_each_format_decodes_to_the_audio_synthesised(fmt):
    world, client = await _client(ModelKind.TTS)
    try:
        r = await client.post("/v1/audio/speech", json={
            "model": "fake", "input": "Hello there.", "voice": "onyx", "response_format": fmt,
            "speed": 1.5})
        assert r.status == 200, await r.text()
        data = await r.read()
        seconds = decode_audio(data, 16000).size / 16000
        assert 0.45 <= seconds <= 0.6, seconds  # five chunks of 0.1 s (codec padding aside)
        g = _sent(world)
        assert g.task is Task.SPEAK and g.prompt == "Hello there."
        assert g.speech.voice == "onyx" and g.speech.speed == 1.5
    finally:
        await client.close()


async def test_speech_pcm_is_24khz_16bit_and_sse_streams_base64_chunks():
    world, client = await _client(ModelKind.TTS)
    try:
        r = await client.post("/v1/audio/speech", json={
            "model": "fake", "input": "x", "response_format": "pcm"})
        assert r.status == 200 and r.content_type == "audio/pcm"
        pcm = np.frombuffer(await r.read(), "<i2")
        assert abs(pcm.size - PCM_RATE * 5 * 1600 // FAKE_RATE) <= 64
        assert 0.2 < np.abs(pcm).max() / 32767 < 0.3  # the 0.25 tone, resampled
        r = await client.post("/v1/audio/speech", json={
            "model": "fake", "input": "x", "voice": {"id": "fable"},
            "response_format": "wav", "stream_format": "sse"})
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                  if line.startswith("data: ")]
        for e in events:
            validate(e, "CreateSpeechResponseStreamEvent", strict=True)
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"] == {"input_tokens": 1, "output_tokens": 5, "total_tokens": 6}
        wav = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert len(events) >= 3 and wav.startswith(b"RIFF")
        assert decode_audio(wav, FAKE_RATE).size == 5 * 1600
    finally:
        await client.close()


async def test_openai_voice_names_speak_in_the_models_voices():
    world, client = await _client(ModelKind.TTS)
    try:
        sent = []
        # the first request loads the model: an OpenAI name waits for its voices
        for voice in ("alloy", "ash", "onyx", "fable", "shimmer"):
            r = await client.post("/v1/audio/speech", json={
                "model": "fake", "input": "x", "voice": voice, "response_format": "pcm"})
            assert r.status == 200, await r.text()
            sent.append(_sent(world).speech.voice)
        assert sent == ["fable", "onyx", "onyx", "fable", "onyx"]
    finally:
        await client.close()


def test_the_voice_mapping_prefers_the_models_own_names():
    kokoro = ["af_alloy", "af_heart", "am_echo", "bm_fable"]
    m = aliases(kokoro)
    assert m["alloy"] == "af_alloy" and m["echo"] == "am_echo" and m["fable"] == "bm_fable"
    assert m["ash"] == "af_alloy" and m["ballad"] == "af_heart"  # the rest in turn
    assert aliases(list(reversed(kokoro)))["alloy"] == "af_alloy"  # stable: by name
    assert aliases(kokoro) == m and aliases([]) == {}
    assert set(m) == set(OPENAI_VOICES)
    assert resolve("af_heart", kokoro) == "af_heart" and resolve("zz", kokoro) == "zz"
    assert resolve(None, kokoro) is None and resolve("alloy", kokoro) == "af_alloy"


def test_the_names_are_the_specifications():
    schemas = spec()["components"]["schemas"]
    words = schemas["CreateSpeechRequest"]["properties"]["voice"]["description"]
    shared = schemas["VoiceIdsShared"]["anyOf"][1]["enum"]
    named = set(re.findall(r"`([a-z]+)`", words.split("custom voice")[0]))
    assert set(OPENAI_VOICES) == named | set(shared)


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": "fake"}, "input"),
    ({"model": "fake", "input": "   "}, "input"),
    ({"model": "fake", "input": "x" * 4097}, "input"),
    ({"model": "fake", "input": "x", "voice": 3}, "voice"),
    ({"model": "fake", "input": "x", "response_format": "ogg"}, "response_format"),
    ({"model": "fake", "input": "x", "speed": 5}, "speed"),
    ({"model": "fake", "input": "x", "speed": True}, "speed"),
    ({"model": "fake", "input": "x", "stream_format": "chunks"}, "stream_format"),
    ({"model": "fake", "input": "x", "voice": "bella"}, "voice"),
])
async def test_bad_speech_bodies_are_400s_naming_the_param(body, param):
    world, client = await _client(ModelKind.TTS)
    try:
        err = await _error(await client.post("/v1/audio/speech", json=body), 400, param)
        if body.get("voice") == "bella":  # the worker's refusal lists the voices
            assert "fable" in err["message"] and "onyx" in err["message"]
    finally:
        await client.close()


async def test_models_list_kinds_capabilities_and_voices():
    for kind, caps in ((ModelKind.STT, ["audio.transcriptions", "audio.translations"]),
                       (ModelKind.TTS, ["audio.speech"])):
        world, client = await _client(kind)
        try:
            await client.post("/v1/audio/speech", json={"model": "fake", "input": "x"})
            entry = (await (await client.get("/v1/models/fake")).json())
            assert entry["kind"] == kind.value and entry["capabilities"] == caps
            assert ("voices" in entry) is (kind is ModelKind.TTS)
            if kind is ModelKind.TTS:
                assert entry["voices"] == ["fable", "onyx"]
                aliases = entry["voice_aliases"]  # OpenAI's other names, the voices in turn
                assert aliases["alloy"] == "fable" and aliases["ash"] == "onyx"
                assert aliases["ballad"] == "fable" and "fable" not in aliases
                assert set(aliases.values()) == {"fable", "onyx"} and len(aliases) == 11
        finally:
            await client.close()
