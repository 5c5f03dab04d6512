"""POST /v1/audio/speech: text to speech, OpenAI's shape.

One Generate of task SPEAK on a speech synthesis worker (worker/speech/); its audio comes
back as it is synthesised (Audio messages, mono float32) and goes out at once, encoded in
the `response_format` asked (encode.py): the body streams, so a client starts playing
before the synthesis ends. `stream_format: "sse"` sends OpenAI's `speech.audio.delta`
events (base64 chunks of the encoded audio) and a `speech.audio.done` instead.

`voice` is one of the model's voices or one of OpenAI's built-in names, which stand for
the model's voices (voices.py); a model still loading is waited for when such a name
needs its list. A failure before the first audio keeps its HTTP status (a 400 for an
unknown voice, listing the voices); after it, the body is cut short (the status line has
gone out).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from protocol import Audio, Generate, SpeechSpec, Task
from supervisor.api.audio.encode import CONTENT_TYPES, FORMATS, Encoder
from supervisor.api.audio.voices import is_alias, resolve
from supervisor.api.lifecycle import log_request, queue
from supervisor.http import sse
from supervisor.http.errors import APIError, read_json
from supervisor.keys import CONFIG, POOL

MAX_INPUT = 4096  # characters, as OpenAI's


@dataclass(frozen=True)
class SpeechRequest:
    model: str
    input: str
    voice: str | None
    response_format: str
    speed: float
    sse: bool

    def to_generate(self, voices: list[str]) -> Generate:
        """`voices`: the model's, to map an OpenAI voice name onto (voices.py)."""
        return Generate(rid="", task=Task.SPEAK, prompt=self.input,
                        speech=SpeechSpec(voice=resolve(self.voice, voices), speed=self.speed))


def parse(body: dict) -> SpeechRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError.bad_request("Missing required parameter: 'model'.", "model")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise APIError.bad_request("'input' must be a non-empty string: the text to speak.",
                                   "input")
    if len(text) > MAX_INPUT:
        raise APIError.bad_request(f"'input' is longer than {MAX_INPUT} characters.", "input",
                                   "string_above_max_length")
    voice = body.get("voice")
    if isinstance(voice, dict):  # a custom voice object: {"id": ...}
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise APIError.bad_request("'voice' must be a string (a voice of the model).", "voice")
    fmt = body.get("response_format", "mp3")
    if fmt not in FORMATS:
        raise APIError.bad_request(f"Invalid value for 'response_format': supported: "
                                   f"{', '.join(FORMATS)}.", "response_format", "invalid_value")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4:
        raise APIError.bad_request("Invalid value for 'speed': expected a number from 0.25 "
                                   "to 4.", "speed", "invalid_value")
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise APIError.bad_request("Invalid value for 'stream_format': audio or sse.",
                                   "stream_format", "invalid_value")
    return SpeechRequest(model, text, voice or None, fmt, float(speed), stream_format == "sse")


async def speech(request: web.Request) -> web.StreamResponse:
    parsed = parse(await read_json(request))
    runner = await request.app[POOL].get(parsed.model)
    if is_alias(parsed.voice) and not runner.voices:  # loading: its voices come with it
        await runner.wait_loaded(request.app[CONFIG].queue_timeout)
    gen = await queue(request, runner, parsed.to_generate(runner.voices))
    t0 = time.monotonic()
    try:
        await gen.started()
        items = _audio(gen.batches(idle=sse.PING_INTERVAL_S if parsed.sse else None))
        item = await anext(items, _END)  # a failure before the first audio keeps its status
        if parsed.sse:
            resp = await sse.open_stream(request)
        else:
            resp = web.StreamResponse(
                headers={"Content-Type": CONTENT_TYPES[parsed.response_format]})
            await resp.prepare(request)
        encoder = None
        while item is not _END:
            if item is None:  # quiet for a while (SSE only): keep the connection alive
                await resp.write(sse.PING)
            else:
                if encoder is None:
                    encoder = Encoder(parsed.response_format, item.sample_rate)
                samples = np.frombuffer(item.data, "<f4")
                await _send(resp, parsed, await asyncio.to_thread(encoder.feed, samples))
            item = await anext(items, _END)
        if encoder is not None:
            await _send(resp, parsed, await asyncio.to_thread(encoder.close))
        if parsed.sse:
            done = gen.done  # the worker's counts: the text's tokens, the audio's
            usage = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                     "total_tokens": done.prompt_tokens + done.completion_tokens}
            await resp.write(sse.encode_event({"type": "speech.audio.done", "usage": usage}))
        await resp.write_eof()
        return resp
    finally:
        gen.close()
        log_request(request, gen, runner.id, True, t0)


_END = object()


async def _audio(batches):
    """The Audio messages in order; None for an empty batch (a quiet interval)."""
    async for batch in batches:
        if not batch:
            yield None
        for item in batch:
            if isinstance(item, Audio):
                yield item


async def _send(resp: web.StreamResponse, parsed: SpeechRequest, data: bytes) -> None:
    if not data:
        return
    if parsed.sse:
        await resp.write(sse.encode_event({"type": "speech.audio.delta",
                                           "audio": base64.b64encode(data).decode("ascii")}))
    else:
        await resp.write(data)


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/audio/speech", speech)
