"""Media in requests (supervisor/api/fields/media.py). Chat images and audio clips travel
to the worker (their bytes in Generate.images and .audios, a part where they were),
within their limits (the worker refuses what its model cannot read); media no model here
reads, on every surface: in the turn being answered a 400 naming the part, earlier in
the history a placeholder, so a conversation that began with a vision model can go on
with a text one; shapes checked wherever the part is."""

from __future__ import annotations

import pytest

from supervisor.api.chat.request import parse_chat_request
from supervisor.api.responses.items import normalize_input, to_chat_messages
from supervisor.api.fields.media import MAX_IMAGE_BYTES
from supervisor.config import Config
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


@pytest.mark.parametrize("part, noun", [({"type": "file", "file": {"file_id": "f"}}, "files")])
def test_chat_media_in_the_last_user_turn_is_a_400_naming_it(part, noun):
    with pytest.raises(APIError) as e:
        chat(user(text("earlier")), {"role": "assistant", "content": "ok"},
             user(text("what is this?"), part))
    assert e.value.status == 400 and e.value.param == "messages[2].content[1].type"
    assert f"cannot read {noun}" in e.value.message


def test_chat_media_earlier_in_the_history_becomes_a_placeholder():
    r = chat(user({"type": "file", "file": {"file_id": "f"}}, text("what is it?")),
             {"role": "assistant", "content": "A cat."}, user(text("and now?")))
    assert r.messages[0]["content"] == "[file]\nwhat is it?"
    assert r.messages[-1]["content"] == "and now?"


def test_chat_audio_travels_as_parts_and_bytes_in_order_beside_images():
    mp3 = {"type": "input_audio", "input_audio": {"data": "SUQz", "format": "mp3"}}
    r = chat(user(AUDIO, text("what is it?")), {"role": "assistant", "content": "A cat."},
             user(text("and now?"), IMAGE, mp3))
    assert r.messages[0]["content"] == [{"type": "audio"},
                                        {"type": "text", "text": "what is it?"}]
    assert r.messages[2]["content"] == [{"type": "text", "text": "and now?"}, {"type": "image"},
                                        {"type": "audio"}]
    gen = r.to_generate(Config())
    assert gen.audios == (b"\x00\x00\x00", b"ID3") and gen.images == (b"\x89PNG\r\n\x1a\n",)


@pytest.mark.parametrize("payload, status, code, param", [
    ({"data": "AAAA", "format": "flac"}, 400, "invalid_value", "input_audio.format"),
    ({"data": "AAAA"}, 400, "invalid_value", "input_audio.format"),
    ({"data": 5, "format": "wav"}, 400, "invalid_type", "input_audio.data"),
    ({"data": "###", "format": "wav"}, 400, "invalid_value", "input_audio.data"),
    ({"data": "", "format": "wav"}, 400, "invalid_value", "input_audio.data"),
    ({"data": "A" * (28 << 20), "format": "wav"}, 413, "audio_too_large", "input_audio.data"),
])
def test_chat_audio_is_base64_wav_or_mp3_within_the_limit(payload, status, code, param):
    with pytest.raises(APIError) as e:
        chat(user(text("?"), {"type": "input_audio", "input_audio": payload}))
    assert (e.value.status, e.value.code) == (status, code)
    assert e.value.param == f"messages[0].content[1].{param}"


def test_chat_audio_clips_per_request_are_bounded():
    from supervisor.api.fields.media import MAX_AUDIOS, MAX_IMAGES

    with pytest.raises(APIError) as e:
        chat(user(*[AUDIO] * (MAX_AUDIOS + 1)))
    assert e.value.status == 400 and e.value.code == "too_many_audio_clips"
    r = chat(user(*[AUDIO] * MAX_AUDIOS, *[IMAGE] * MAX_IMAGES))  # (counted apart)
    assert len(r.to_generate(Config()).audios) == MAX_AUDIOS


def test_a_model_that_hears_audio_lists_the_audio_capability():
    from supervisor.api.models import capabilities

    assert capabilities("vision", hears_audio=True)[-1] == "audio"
    assert "audio" not in capabilities("vision") + capabilities("text")


def test_chat_images_travel_as_parts_and_bytes_in_order():
    second = {"type": "image_url", "image_url": "data:image/jpeg;base64,/9j/4AAQ"}
    r = chat(user(text("a"), IMAGE, text("b"), text("c")), {"role": "assistant", "content": "x"},
             user(second, text("d")))
    assert r.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"},
                                        {"type": "text", "text": "b\nc"}]
    assert r.messages[2]["content"] == [{"type": "image"}, {"type": "text", "text": "d"}]
    assert r.images == (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0\x00\x10")
    gen = r.to_generate(Config())
    assert gen.images == r.images and gen.messages[0]["content"][1] == {"type": "image"}


# http(s) URLs parse; they are fetched or refused (--allow-remote-media) after the
# request is built: tests/supervisor/test_remote_media.py.
@pytest.mark.parametrize("url, status, code", [
    ("ftp://example.com/cat.png", 400, "invalid_image_url"),
    ("cat.png", 400, "invalid_image_url"),  # a relative path
    ("data:image/png;base64,###", 400, "invalid_image_url"),
    ("data:image/png;base64,", 400, "invalid_image_url"),
    ("data:image/png;base64," + "A" * (28 << 20), 413, "image_too_large"),
])
def test_chat_image_urls_are_data_urls_within_the_limit(url, status, code):
    with pytest.raises(APIError) as e:
        chat(user(text("?"), {"type": "image_url", "image_url": {"url": url}}))
    assert (e.value.status, e.value.code) == (status, code)
    assert e.value.param == "messages[0].content[1].image_url.url"


def test_chat_images_per_request_are_bounded():
    from supervisor.api.fields.media import MAX_IMAGES

    with pytest.raises(APIError) as e:
        chat(user(*[IMAGE] * (MAX_IMAGES + 1)))
    assert e.value.status == 400 and e.value.code == "too_many_images"
    assert len(chat(user(*[IMAGE] * MAX_IMAGES)).images) == MAX_IMAGES


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


def test_responses_input_images_and_audio_travel_and_files_in_the_last_turn_are_a_400():
    from supervisor.api.fields.media import split

    items = normalize_input([{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": PNG},
        AUDIO]}])
    media = []
    messages = to_chat_messages(items, None, media)
    assert messages[0]["content"] == [{"type": "text", "text": "what is it?"}, {"type": "image"},
                                      {"type": "audio"}]
    assert split(media) == ([b"\x89PNG\r\n\x1a\n"], (b"\x00\x00\x00",))
    with pytest.raises(APIError) as e:
        normalize_input([{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"},
            {"type": "input_file", "file_id": "file-1"}]}])
    assert e.value.status == 400 and e.value.param == "input[0].content[1].type"
    assert "cannot read files" in e.value.message


@pytest.mark.parametrize("part, param", [
    ({"type": "input_image", "image_url": "ftp://example.com/a.png"},
     "input[0].content[0].image_url"),
    ({"type": "input_image", "file_id": "file-1"}, "input[0].content[0].file_id"),
])
def test_responses_images_are_data_urls(part, param):
    with pytest.raises(APIError) as e:
        normalize_input([{"role": "user", "content": [part]}])
    assert e.value.status == 400 and e.value.param == param


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
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}},
     "input[0].content[0].input_audio.format"),
    ({"type": "input_image", "image_url": PNG, "detail": "max"}, "input[0].content[0].detail"),
    ({"type": [], "text": "hi"}, "input[0].content[0].type"),  # (the fuzzer found it)
])
def test_responses_malformed_media_is_a_400(part, param):
    with pytest.raises(APIError) as e:
        normalize_input([{"role": "user", "content": [part]},
                         {"role": "user", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == param


def test_local_images_are_read_only_from_the_allowed_media_dirs(tmp_path):
    from supervisor.api.fields.media import resolve

    allowed, elsewhere = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    elsewhere.mkdir()
    (allowed / "cat.png").write_bytes(b"\x89PNG cat")
    (elsewhere / "secret.png").write_bytes(b"secret")
    (allowed / "escape.png").symlink_to(elsewhere / "secret.png")
    big = allowed / "big.png"
    with open(big, "wb") as f:
        f.truncate(MAX_IMAGE_BYTES + 1)

    def built(url, dirs):
        r = chat(user(text("?"), {"type": "image_url", "image_url": {"url": url}}))
        return r.to_generate(Config(allowed_media_dirs=tuple(dirs)))

    for url in (f"file://{allowed}/cat.png", f"{allowed}/cat.png", f"{allowed}/../media/cat.png"):
        assert built(url, [allowed]).images == (b"\x89PNG cat",)
    for url, dirs, status, words in (
            (f"{allowed}/cat.png", [], 400, "local files are off"),
            (f"{elsewhere}/secret.png", [allowed], 400, "no image file there"),
            (f"{allowed}/escape.png", [allowed], 400, "no image file there"),  # a symlink out
            (f"{allowed}/missing.png", [allowed], 400, "no image file there"),
            (f"{allowed}", [allowed], 400, "no image file there"),
            (f"{big}", [allowed], 413, "at most")):
        with pytest.raises(APIError) as e:
            built(url, dirs)
        assert e.value.status == status and words in e.value.message, url
        assert e.value.param == "messages[0].content[1].image_url.url"
    assert resolve((b"inline",), []) == (b"inline",)
