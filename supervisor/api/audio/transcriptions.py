"""POST /v1/audio/transcriptions and /v1/audio/translations: speech to text, OpenAI's shapes.

The file travels to the worker as sent (it decodes it: worker/media/decode.py); the
request is one Generate of task TRANSCRIBE riding the one request lifecycle (admission,
queue and request timeouts, cancel when the client leaves, exactly one Done). The text
comes back stretch by stretch (Deltas: Whisper's windows) and whole in a Transcript, which
is rendered in the `response_format` asked: json, text, verbose_json (segments and words
by `timestamp_granularities[]`), srt, vtt. `stream=true` (json or text) sends OpenAI's
`transcript.text.delta` events as the stretches come and a `transcript.text.done` with the
whole text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from protocol import Generate, SamplingParams, SpeechSpec, Task, Transcript
from supervisor.api.audio.form import Form, read_form
from supervisor.api.audio.subtitles import srt, vtt
from supervisor.api.lifecycle import log_request, submit
from supervisor.http import sse
from supervisor.http.errors import APIError
from supervisor.keys import CONFIG
from supervisor.workers.errors import Internal

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")


@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    audio: bytes
    translate: bool
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float | None
    granularities: tuple[str, ...]
    stream: bool

    def to_generate(self) -> Generate:
        timed = self.response_format in ("srt", "vtt", "verbose_json")
        return Generate(
            rid="", task=Task.TRANSCRIBE, audio=self.audio, prompt=self.prompt,
            sampling=SamplingParams(temperature=self.temperature),
            speech=SpeechSpec(language=self.language, translate=self.translate,
                              segments=timed, words="word" in self.granularities))


def parse(form: Form, translate: bool) -> TranscriptionRequest:
    if form.file is None:
        raise APIError.bad_request("Missing required parameter: 'file' (the audio file, as "
                                   "a multipart/form-data file field).", "file")
    model = form.get("model")
    if not model:
        raise APIError.bad_request("Missing required parameter: 'model'.", "model")
    response_format = form.get("response_format") or "json"
    if response_format not in FORMATS:
        raise APIError.bad_request(
            f"Invalid value for 'response_format': {response_format[:40]!r}; supported: "
            f"{', '.join(FORMATS)}.", "response_format", "invalid_value")
    temperature = _float(form.get("temperature"), "temperature", 0.0, 1.0)
    granularities = tuple(dict.fromkeys(form.all("timestamp_granularities")))
    bad = [g for g in granularities if g not in GRANULARITIES]
    if bad:
        raise APIError.bad_request(f"Invalid value for 'timestamp_granularities': "
                                   f"{bad[0][:40]!r}; supported: segment, word.",
                                   "timestamp_granularities", "invalid_value")
    if granularities and response_format != "verbose_json":
        raise APIError.bad_request("timestamp_granularities needs response_format "
                                   "verbose_json.", "timestamp_granularities")
    stream = _bool(form.get("stream"), "stream")
    if stream and response_format not in ("json", "text"):
        raise APIError.bad_request("stream=true streams text: response_format must be json "
                                   "or text.", "stream")
    if "logprobs" in form.all("include"):
        raise APIError.bad_request("include[]=logprobs is not available for transcriptions "
                                   "on this server.", "include")
    chunking = form.get("chunking_strategy")
    if chunking not in (None, "", "auto"):
        raise APIError.bad_request("chunking_strategy: only 'auto' (the model's own "
                                   "windows) is available.", "chunking_strategy")
    language = None if translate else (form.get("language") or None)
    if language is not None and not (language.isascii() and language.isalpha()
                                     and 2 <= len(language) <= 3):
        raise APIError.bad_request("Invalid value for 'language': use an ISO-639-1 code "
                                   "such as 'en'.", "language", "invalid_value")
    return TranscriptionRequest(model, form.file, translate, language and language.lower(),
                                form.get("prompt") or None, response_format, temperature,
                                granularities or ("segment",), stream)


def _float(raw: str | None, name: str, low: float, high: float) -> float | None:
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise APIError.bad_request(f"Invalid value for '{name}': expected a number from "
                                   f"{low:g} to {high:g}.", name, "invalid_value")
    return value


def _bool(raw: str | None, name: str) -> bool:
    if raw is None or raw.lower() in ("", "false", "0"):
        return False
    if raw.lower() in ("true", "1"):
        return True
    raise APIError.bad_request(f"Invalid value for '{name}': expected true or false.", name,
                               "invalid_value")


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, translate=False)


async def translations(request: web.Request) -> web.StreamResponse:
    return await _serve(request, translate=True)


async def _serve(request: web.Request, translate: bool) -> web.StreamResponse:
    form = await read_form(request, request.app[CONFIG].max_audio_bytes)
    parsed = parse(form, translate)
    runner, gen = await submit(request, parsed.model, parsed.to_generate())
    t0 = time.monotonic()
    try:
        await gen.started()
        if parsed.stream:
            return await _stream(request, gen)
        async for _ in gen.batches():
            pass  # the text comes whole in the Transcript, before the Done
        return _render(parsed, _transcript(gen))
    finally:
        gen.close()
        log_request(request, gen, runner.id, parsed.stream, t0)


def _transcript(gen) -> Transcript:
    result = gen.handle.result
    if not isinstance(result, Transcript):
        raise Internal()  # a worker that ends a transcription without it: our bug
    return result


async def _stream(request: web.Request, gen) -> web.StreamResponse:
    resp = await sse.open_stream(request)
    async for batch in gen.batches(idle=sse.PING_INTERVAL_S):
        if not batch:
            await resp.write(sse.PING)
            continue
        text = "".join(d.text for d in batch)
        if text:
            await resp.write(sse.encode_event({"type": "transcript.text.delta",
                                               "delta": text}))
    done = _transcript(gen)
    await resp.write(sse.encode_event({"type": "transcript.text.done", "text": done.text}))
    await resp.write_eof()
    return resp


def _render(parsed: TranscriptionRequest, t: Transcript) -> web.Response:
    fmt = parsed.response_format
    if fmt == "text":
        return web.Response(text=t.text + "\n", content_type="text/plain")
    if fmt == "srt":
        return web.Response(text=srt(t.segments), content_type="application/x-subrip")
    if fmt == "vtt":
        return web.Response(text=vtt(t.segments), content_type="text/vtt")
    # Usage is the audio's length (OpenAI's duration usage); its translation objects
    # have none.
    usage = {} if parsed.translate else {
        "usage": {"type": "duration", "seconds": round(t.duration, 3)}}
    if fmt == "json":
        return web.json_response({"text": t.text, **usage})
    body = {"language": "english" if parsed.translate else t.language,
            "duration": round(t.duration, 3), "text": t.text}
    if "segment" in parsed.granularities:
        body["segments"] = [
            {"id": i, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
             "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
             "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
            for i, s in enumerate(t.segments)]
    if "word" in parsed.granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in t.words]
    return web.json_response({**body, **usage})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", translations)
