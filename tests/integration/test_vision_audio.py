"""Audio inputs served end to end (supervisor/api/fields/media.py, worker/vision/audio.py):
the real supervisor and a vision worker on the tiny Gemma 4 (an audio tower), driven by
the official openai client. A chat completion and a Responses request carry an
`input_audio` clip (Responses takes the spec's InputAudio part shape, which the spec
lists for evals only); `/v1/models` shows the `audio` capability; a clip the model cannot
take is a 400 in each surface's envelope; the same clip sent again is reused from the
prompt cache and says so in `cached_tokens`, and another clip of the same length is not.
Random weights: asserts on structure, not on words."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from bench.multimodal import tone_wav
from tests.integration.conftest import assert_envelope
from tests.integration.test_vision_cache import cached
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gemma4_model(models_dir):
    from worker.demos.vision import build_vision_model

    return str(build_vision_model(models_dir / "tiny-vision-gemma4", family="gemma4").path)


@pytest.fixture(scope="module")
def aserver(gemma4_model):
    with ServerProcess([gemma4_model]) as srv:
        srv.wait_healthy(timeout=180)
        yield srv


@pytest.fixture
def aclient(aserver):
    return openai.OpenAI(base_url=f"{aserver.url}/v1", api_key="x", max_retries=0)


def clip(seconds: float = 0.3, rate: int = 16_000) -> dict:
    """An input_audio payload: a tone as base64 WAV (another rate, the same length:
    other bytes, as many audio tokens)."""
    return {"data": base64.b64encode(tone_wav(seconds, rate)).decode(), "format": "wav"}


def chat_with(audio: dict, text: str = "What is said?") -> list:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": audio},
                                         {"type": "text", "text": text}]}]


def test_the_model_lists_the_audio_capability(aclient, gemma4_model):
    entry = aclient.models.retrieve(gemma4_model).model_extra
    assert entry["kind"] == "vision" and "audio" in entry["capabilities"]


def test_chat_with_a_clip_answers_and_the_clip_sent_again_is_cached(aclient, gemma4_model):
    def ask(audio):
        return aclient.chat.completions.create(model=gemma4_model, messages=chat_with(audio),
                                               max_tokens=3, temperature=0)

    text_only = aclient.chat.completions.create(
        model=gemma4_model, messages=[{"role": "user", "content": "What is said?"}],
        max_tokens=3, temperature=0)
    first = ask(clip())
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 3
    # The clip's tokens count as prompt tokens (0.3 s: 8 audio tokens, and their markers).
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + 8
    again = ask(clip())
    assert cached(first) == 0 and cached(again) >= first.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    # Another clip of the same length (the same token ids): not reused past its start.
    other = ask(clip(rate=8_000))
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert cached(other) <= first.usage.prompt_tokens - 8 - 4


def test_a_responses_request_with_a_clip_answers(aclient, gemma4_model):
    r = aclient.responses.create(model=gemma4_model, max_output_tokens=3, temperature=0,
                                 input=[{"role": "user", "content": [
                                     {"type": "input_audio", "input_audio": clip(0.2)},
                                     {"type": "input_text", "text": "What is said?"}]}])
    assert r.status == "incomplete" and r.usage.output_tokens == 3
    assert r.usage.input_tokens > 8 and r.output[0].content[0].text


@pytest.mark.parametrize("audio, says", [
    (clip(3.0), "longer than"),
    ({"data": base64.b64encode(b"RIFF not a wave").decode(), "format": "wav"},
     "could not be decoded")])
def test_a_clip_the_model_cannot_take_is_a_400_on_each_surface(aserver, gemma4_model, audio,
                                                                says):
    with httpx.Client(base_url=aserver.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={
            "model": gemma4_model, "messages": chat_with(audio), "max_tokens": 2})
        error = assert_envelope(r, 400, param="messages")
        assert says in error["message"] and error["type"] == "invalid_request_error", error
        r = http.post("/v1/responses", json={
            "model": gemma4_model, "max_output_tokens": 2, "input": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": audio}]}]})
        error = assert_envelope(r, 400, param="input")
        assert says in error["message"] and error["type"] == "invalid_request_error", error
