"""Media a text model cannot read (supervisor/api/parse/media.py), on every surface: in
the turn being answered a 400 naming the part; earlier in the history a placeholder, so a
conversation that began with a vision model can go on with a text one; shapes checked
wherever the part is."""

from __future__ import annotations

import pytest

from supervisor.api.parse.chat import parse_chat_request
from supervisor.api.responses.items import normalize_input, to_chat_messages
from supervisor.http.errors import APIError

PNG = "data:image/png;base64,iVBORw0KGgo="
IMAGE = {"type": "image_url", "image_url": {"url": PNG}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


def chat(*messages):
    return parse_chat_request({"model": "m", "messages": list(messages)})


def user(*parts):
    return {"role": "user", "content": list(parts)}


def text(t):
    return {"type": "text", "text": t}


@pytest.mark.parametrize("part, noun", [(IMAGE, "images"), (AUDIO, "audio"),
                                        ({"type": "image_url", "image_url": PNG}, "images")])
def test_chat_media_in_the_last_user_turn_is_a_400_naming_it(part, noun):
    with pytest.raises(APIError) as e:
        chat(user(text("earlier")), {"role": "assistant", "content": "ok"},
             user(text("what is this?"), part))
    assert e.value.status == 400 and e.value.param == "messages[2].content[1].type"
    assert f"cannot read {noun}" in e.value.message


def test_chat_media_earlier_in_the_history_becomes_a_placeholder():
    r = chat(user(IMAGE, text("what is it?")), {"role": "assistant", "content": "A cat."},
             user(AUDIO), {"role": "assistant", "content": "Purring."},
             user(text("and now?")))
    assert r.messages[0]["content"] == "[image]\nwhat is it?"
    assert r.messages[2]["content"] == "[audio]"
    assert r.messages[-1]["content"] == "and now?"


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url"}, "messages[0].content[0].image_url"),
    ({"type": "image_url", "image_url": {"url": 3}}, "messages[0].content[0].image_url.url"),
    ({"type": "input_audio", "input_audio": "x"}, "messages[0].content[0].input_audio"),
])
def test_a_malformed_media_part_is_a_400_even_in_the_history(part, param):
    with pytest.raises(APIError) as e:
        chat(user(part), {"role": "assistant", "content": "?"}, user(text("hi")))
    assert e.value.status == 400 and e.value.param == param


def test_media_in_an_assistant_turn_is_refused():
    with pytest.raises(APIError) as e:
        chat({"role": "assistant", "content": [IMAGE]}, user(text("hi")))
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].type"


def test_responses_input_image_in_the_last_user_turn_is_a_400():
    with pytest.raises(APIError) as e:
        normalize_input([{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"},
            {"type": "input_image", "image_url": PNG}]}])
    assert e.value.status == 400 and e.value.param == "input[0].content[1].type"
    assert "cannot read images" in e.value.message


def test_responses_media_earlier_is_kept_and_placeheld_in_the_prompt():
    items = normalize_input([
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG, "detail": "low"},
                                     {"type": "input_text", "text": "what is it?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]},
        {"role": "assistant", "content": "A file."},
        {"role": "user", "content": "and now?"}])
    # Stored as sent (a later turn replays it), shown as a placeholder to a text model.
    assert items[0]["content"][0] == {"type": "input_image", "image_url": PNG, "detail": "low"}
    messages = to_chat_messages(items, None)
    assert messages[0]["content"] == "[image]\nwhat is it?"
    assert messages[2]["content"] == "[file]"
    assert messages[-1]["content"] == "and now?"


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image"}, "input[0].content[0]"),
    ({"type": "input_image", "image_url": 5}, "input[0].content[0].image_url"),
    ({"type": "input_audio", "input_audio": "x"}, "input[0].content[0].input_audio"),
    ({"type": "input_image", "image_url": PNG, "detail": "max"}, "input[0].content[0].detail"),
    ({"type": [], "text": "hi"}, "input[0].content[0].type"),  # (the fuzzer found it)
])
def test_responses_malformed_media_is_a_400(part, param):
    with pytest.raises(APIError) as e:
        normalize_input([{"role": "user", "content": [part]},
                         {"role": "user", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == param
