"""The playground (/ui/chat) in headless Chromium against a real server: a chat streams
and stops on Stop (the server cancels it), a reply shows its timings and cached tokens,
the curl box holds the request sent, an image goes to a vision model, audio (a file, or
recorded from Chromium's fake microphone) to a speech-to-text model, text to a
text-to-speech model. No prompt ever travels in a URL."""

from __future__ import annotations

import io
import re
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from bench.multimodal import tone_wav

from tests.ui.conftest import until

pytestmark = pytest.mark.integration

PROMPT = "Tell me a long story about a lighthouse keeper"


def open_playground(page, srv, model) -> None:
    p = page.page
    p.goto(srv.url + "/ui/chat")
    p.wait_for_selector(f'#model option[value="{model}"]', state="attached")
    p.select_option("#model", str(model))


def in_flight(srv) -> int:
    return sum(w["in_flight"] for w in httpx.get(srv.url + "/health", timeout=10).json()["workers"])


def last_reply(p):
    return p.locator(".msg.assistant").last


def test_a_chat_streams_stops_on_stop_and_the_next_reply_shows_its_numbers(
        page, ui_server, tiny_model):
    p = page.page
    open_playground(page, ui_server, tiny_model)
    # Long enough that Stop, however late a busy machine clicks it, comes first; the
    # pages' model has the window for what it wrote by then (tests/ui/conftest.py).
    p.fill("#max-tokens", "20000")
    p.fill("#temperature", "0")
    p.fill("#prompt", PROMPT)
    p.click("#send")
    reply = last_reply(p)
    # Streaming: text is on the page while the request still runs.
    until(p, 
        "document.querySelector('.msg.assistant:last-child .content').textContent.length > 0"
        " && !document.querySelector('#stop').disabled")
    assert reply.get_attribute("data-finish") is None
    assert in_flight(ui_server) == 1
    p.click("#stop")
    p.wait_for_selector(".msg.assistant[data-finish=stopped]")
    assert "finish: stopped" in reply.locator(".stats").inner_text()
    deadline = time.monotonic() + 10
    while in_flight(ui_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(ui_server) == 0, "the server kept generating after Stop"

    # Two more turns, each sending the whole conversation again: the third one's prefix
    # is the second one's prompt and reply, which the worker's prompt cache kept.
    p.fill("#max-tokens", "8")
    for turn, text in ((4, "and then?"), (6, "go on")):
        p.fill("#prompt", text)
        p.keyboard.press("Enter")   # Enter sends
        p.wait_for_selector(f".msg.assistant:nth-child({turn})[data-finish]")
        answered = last_reply(p)
        assert answered.get_attribute("data-finish") == "length", answered.inner_text()[-2000:]
    stats = last_reply(p).locator(".stats").inner_text()
    assert "TTFT" in stats and "tok/s" in stats and re.search(r"\b\d tokens", stats), stats
    cached = int(re.search(r"\((\d+) cached\)", stats).group(1))
    assert cached > 0, stats
    curl = p.locator("#curl").inner_text()
    assert "/v1/chat/completions" in curl and "go on" in curl and PROMPT in curl
    assert '"max_tokens": 8' in curl
    # Prompts went in request bodies, never in an address.
    assert not [r.url for r in page.requests if "lighthouse" in r.url or "then" in r.url]
    page.shot("playground")


def png(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_an_image_goes_to_a_vision_model(page, ui_server, vision_model):
    p = page.page
    open_playground(page, ui_server, vision_model)
    assert p.locator("#image-pick").is_visible()
    p.set_input_files("#image", files=[{"name": "noise.png", "mimeType": "image/png",
                                        "buffer": png()}])
    until(p, "document.querySelector('#attached').innerText.includes('noise.png')")
    p.fill("#max-tokens", "6")
    p.fill("#prompt", "What is in the picture?")
    p.click("#send")
    p.wait_for_selector(".msg.assistant[data-finish=length]")
    assert p.locator(".msg.user img").count() == 1
    assert "KB of base64" in p.locator("#curl").inner_text()   # not megabytes of it
    page.shot("playground-vision")


def test_speech_in_from_a_file_and_the_microphone_and_speech_out(page, ui_server, stt_model,
                                                                 tts_model):
    p = page.page
    open_playground(page, ui_server, stt_model)
    assert p.locator("#send").inner_text() == "Transcribe"
    p.set_input_files("#audio", files=[{"name": "tone.wav", "mimeType": "audio/wav",
                                        "buffer": tone_wav(1.5)}])
    p.click("#send")
    p.wait_for_selector(".msg.assistant[data-finish=stop]", timeout=120_000)
    assert "s of audio" in last_reply(p).locator(".stats").inner_text()
    assert "/v1/audio/transcriptions" in p.locator("#curl").inner_text()

    p.click("#record")                       # Chromium's fake microphone
    until(p, "document.querySelector('#record').innerText === 'Stop recording'")
    time.sleep(1.5)
    p.click("#record")
    until(p, "document.querySelector('#attached').innerText.includes('recording.')")
    p.click("#send")
    p.wait_for_selector(".msg.assistant:nth-child(4)[data-finish=stop]", timeout=120_000)

    p.select_option("#model", str(tts_model))
    assert p.locator("#send").inner_text() == "Speak"
    assert p.locator("#voice option").count() >= 1
    p.fill("#prompt", "hello there")
    p.click("#send")
    p.wait_for_selector(".msg.assistant[data-finish=stop] audio", timeout=120_000)
    until(p, 
        "document.querySelector('.msg.assistant:last-child audio').duration > 0")
    page.shot("playground-speech")
