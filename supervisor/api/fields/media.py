"""Images (and other media) a client sends.

Images travel to the worker (chat `image_url` parts, Responses `input_image` parts,
Messages `image` blocks): their base64 bytes in `Generate.images`, an {"type": "image"}
part where each image was (`image_part`). A
vision model sees them (worker/vision/); a text model's worker applies the rule below to
them, as it alone knows its kind for certain (a request may arrive before the model has
loaded). An image comes inline (a base64 data: URL), as a local file (--allowed-media-dir;
read when the request is built, `resolve`) or, with --allow-remote-media, by http(s) URL
(fetched by the supervisor before the request goes to a worker: `fetch_remote`, through
remote_media.py). Limits: MAX_IMAGES per request (400) and MAX_IMAGE_BYTES per image
(413). Pixels are the worker's (worker/vision/images.py): their bounds follow from the
model's processor, which only the worker loads, so the supervisor reads no image.

Audio clips travel the same way (chat and Responses `input_audio` parts: base64 WAV or
MP3, `audio_part`): an {"type": "audio"} part where each was, its bytes in
`Generate.audios` (kept in the request's media list as an `AudioClip` until the Generate
is built, `split`). Limits: MAX_AUDIOS per request (400), MAX_AUDIO_BYTES per clip (413).
A model whose mlx-vlm class hears audio takes them (worker/vision/audio.py); any other
model's worker applies the rule below to them, as to images a text model is given.

Media no model here reads (chat `file` parts, Responses' `input_file`, Messages'
`document` blocks and the images inside `tool_result`s), and images and audio given to
a model that cannot read them (the worker's side of the rule, worker/text/prompt.py),
follow one rule, so a client can switch models in the middle of a conversation:
- media in the conversation's LAST user turn is what the client asks about now: a 400
  naming the part, saying the model cannot see it (answering as if it had seen it would be
  worse);
- media earlier in the history becomes a short placeholder in the text, so the rest of
  the conversation still reaches the model.
Each part is still checked for its shape, wherever it is.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec

from protocol.messages import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER
from supervisor.api.fields.remote_media import FETCHER
from supervisor.http.errors import INVALID_REQUEST, APIError

MAX_IMAGES = 16
MAX_IMAGE_BYTES = 20 << 20
MAX_AUDIOS = 4
MAX_AUDIO_BYTES = 20 << 20
AUDIO_FORMATS = ("wav", "mp3")  # input_audio's formats (OpenAI's spec)
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w.+-]+=[\w.+-]+)*;base64,", re.I)
_PLACEHOLDERS = {"audio": AUDIO_PLACEHOLDER, "file": "[file]", "document": "[document]"}

NOUNS = {"image_url": "image", "input_image": "image", "image": "image",
         "input_audio": "audio", "input_file": "file", "file": "file", "document": "document"}


def placeholder(kind: str) -> str:
    """The text that stands for a media part of type `kind` in the history."""
    return _PLACEHOLDERS.get(NOUNS.get(kind, "image"), IMAGE_PLACEHOLDER)


def media_part(at: str, kind: str, in_last_user_turn: bool) -> str:
    """A media part of a text model's request: its placeholder, or the 400 when it is in
    the turn being answered."""
    if in_last_user_turn:
        noun = NOUNS.get(kind, "image")
        raise APIError.bad_request(
            f"{at}: the model cannot read {noun}s given here (mlxd passes none of this "
            f"kind to a model yet). Send text, or leave the {noun} out.", f"{at}.type",
            "unsupported_value")
    return placeholder(kind)


def last_user_index(messages: list) -> int:
    """The index of the last user message (-1: none); Responses items of other types
    (function calls and their outputs) are not messages."""
    return max((i for i, m in enumerate(messages) if isinstance(m, dict)
                and m.get("role") == "user" and m.get("type", "message") == "message"),
               default=-1)


@dataclass(frozen=True)
class LocalImage:
    """An image a request names by path: read when the request is built for the worker
    (`resolve`), with the server's --allowed-media-dir."""
    path: str
    param: str


@dataclass(frozen=True)
class RemoteImage:
    """An image a request names by http(s) URL: fetched (`fetch_remote`) after the
    request is built, before it is sent; refused there unless --allow-remote-media."""
    url: str
    param: str


def image_part(at: str, url: str, images: list, param: str | None = None) -> dict:
    """An image part as the worker gets it: {"type": "image"}, its bytes (or, for a local
    file, its LocalImage; for an http(s) URL, its RemoteImage) appended to `images` (the
    request's, in order). 400 for anything but a base64 `data:` URL, an http(s) URL, a
    file:// URL or an absolute path, and for more than MAX_IMAGES; 413 for an image over
    MAX_IMAGE_BYTES. `param`: where the URL is (default: a chat part's `image_url.url`)."""
    param = param or f"{at}.image_url.url"
    match = _DATA_URL.match(url)
    if match is None:
        path = url[len("file://"):] if url.lower().startswith("file://") else url
        if path.startswith("/"):
            _check_room(at, images)
            images.append(LocalImage(path, param))
            return {"type": "image"}
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in ("http", "https"):
            _check_room(at, images)
            images.append(RemoteImage(url, param))
            return {"type": "image"}
        raise APIError.bad_request(f"{param}: only base64 data: URLs, http(s) URLs and local "
                                   "files are accepted; send the image inline as "
                                   "data:image/png;base64,... (or jpeg, webp, gif).", param,
                                   "invalid_image_url")
    return base64_image(at, url[match.end():], images, param)


def base64_image(at: str, body: str, images: list, param: str) -> dict:
    """An image given as base64 text (a data: URL's, or Anthropic's base64 source): its
    bytes appended to `images`; its part for the worker. 400 for text that is not base64,
    an empty image or more than MAX_IMAGES; 413 over MAX_IMAGE_BYTES."""
    _check_room(at, images)
    images.append(_decoded(body, param, ("an image", "the image"), MAX_IMAGE_BYTES,
                           "image_too_large", "invalid_image_url"))
    return {"type": "image"}


def _decoded(body: str, param: str, nouns: tuple[str, str], limit: int, too_large: str,
             invalid: str) -> bytes:
    """A medium's base64 text as bytes: 413 over `limit` bytes (judged before decoding),
    400 for text that is not base64 or nothing at all. `nouns`: ("an image", "the
    image") for the messages."""
    if len(body) * 3 // 4 > limit + 3:
        raise APIError(413, f"{param}: {nouns[0]} may hold at most {limit} bytes.",
                       INVALID_REQUEST, param, too_large)
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise APIError.bad_request(f"{param}: {nouns[1]} is not valid base64.", param,
                                   invalid) from None
    if not data:
        raise APIError.bad_request(f"{param}: {nouns[1]} is empty.", param, invalid)
    return data


def _check_room(at: str, images: list) -> None:
    if sum(not isinstance(i, AudioClip) for i in images) >= MAX_IMAGES:
        raise APIError.bad_request(f"{at}: at most {MAX_IMAGES} images per request.", at,
                                   "too_many_images")


@dataclass(frozen=True)
class AudioClip:
    """An audio part's bytes, in a request's media list beside its images (`split`)."""
    data: bytes


def audio_part(at: str, payload, media: list, param: str) -> dict:
    """An `input_audio` part's payload ({"data": base64, "format": "wav" | "mp3"}) as the
    worker gets it: {"type": "audio"}, an AudioClip of its bytes appended to `media` (the
    request's, in order). 400 for another shape or format, text that is not base64, an
    empty clip or more than MAX_AUDIOS; 413 for a clip over MAX_AUDIO_BYTES."""
    if not isinstance(payload, dict):
        raise APIError.bad_request(f"{param}: expected an object with 'data' and 'format'.",
                                   param, "invalid_type")
    fmt, body = payload.get("format"), payload.get("data")
    if fmt not in AUDIO_FORMATS:
        raise APIError.bad_request(f"{param}.format: {fmt!r} is not one of "
                                   f"{', '.join(AUDIO_FORMATS)}.", f"{param}.format",
                                   "invalid_value")
    if not isinstance(body, str):
        raise APIError.bad_request(f"{param}.data: expected a base64 string.",
                                   f"{param}.data", "invalid_type")
    if sum(isinstance(i, AudioClip) for i in media) >= MAX_AUDIOS:
        raise APIError.bad_request(f"{at}: at most {MAX_AUDIOS} audio clips per request.", at,
                                   "too_many_audio_clips")
    media.append(AudioClip(_decoded(body, f"{param}.data", ("an audio clip", "the audio"),
                                    MAX_AUDIO_BYTES, "audio_too_large", "invalid_value")))
    return {"type": "audio"}


def split(media) -> tuple[list, tuple]:
    """A request's media list → (its images, as `resolve` takes them; its audio clips'
    bytes, Generate.audios)."""
    return ([m for m in media if not isinstance(m, AudioClip)],
            tuple(m.data for m in media if isinstance(m, AudioClip)))


def content(pieces: list):
    """A user message's content from its pieces in order, each a text or an image part:
    the texts joined by newlines when there is no image, else parts (the texts between
    two images joined into one text part), as vision templates read them."""
    if not any(isinstance(p, dict) for p in pieces):
        return "\n".join(pieces)
    parts, texts = [], []
    for p in pieces:
        if isinstance(p, str):
            texts.append(p)
            continue
        if texts:
            parts.append({"type": "text", "text": "\n".join(texts)})
            texts = []
        parts.append(p)
    if texts:
        parts.append({"type": "text", "text": "\n".join(texts)})
    return parts


def resolve(images, allowed_dirs) -> tuple:
    """The request's images as bytes: local files read, each by its real path, only from
    inside `allowed_dirs` (--allowed-media-dir): a 400 for any other path, one that is not
    a readable file, or one over MAX_IMAGE_BYTES (413). The same answer whether a path is
    outside the directories or absent, so a request cannot probe the file system.
    RemoteImages stay as they are, for `fetch_remote`."""
    out = []
    roots = [Path(d).resolve() for d in allowed_dirs]
    for image in images:
        if not isinstance(image, LocalImage):
            out.append(image)
            continue
        if not roots:
            raise APIError.bad_request(f"{image.param}: local files are off on this server "
                                       "(start mlxd with --allowed-media-dir DIR to allow the "
                                       "images in DIR).", image.param, "invalid_image_url")
        path = Path(image.path).resolve()
        inside = any(path.is_relative_to(r) for r in roots)
        try:
            size = path.stat().st_size if inside and path.is_file() else -1
        except OSError:
            size = -1
        if size < 0:
            raise APIError.bad_request(f"{image.param}: no image file there inside the "
                                       "allowed media directories.", image.param,
                                       "invalid_image_url")
        if size > MAX_IMAGE_BYTES:
            raise APIError(413, f"{image.param}: an image may hold at most {MAX_IMAGE_BYTES} "
                           "bytes.", INVALID_REQUEST, image.param, "image_too_large")
        try:
            out.append(path.read_bytes())
        except OSError:
            raise APIError.bad_request(f"{image.param}: the file could not be read.",
                                       image.param, "invalid_image_url") from None
    return tuple(out)


async def fetch_remote(gen, app: Mapping):
    """`gen` (a Generate from a request's `to_generate`) with its RemoteImages fetched
    (all at once; the first failure ends the others), by the app's remote_media.Fetcher:
    the Generate to send. Without one (no --allow-remote-media), a 400 naming the flag.
    A Generate with no remote image is returned as it is, at no cost."""
    remote = [i for i in gen.images if isinstance(i, RemoteImage)]
    if not remote:
        return gen
    fetcher = app.get(FETCHER)
    if fetcher is None:
        param = remote[0].param
        raise APIError.bad_request(
            f"{param}: remote images are not fetched by this server (start mlxd with "
            "--allow-remote-media to allow http(s) image URLs); send the image inline as "
            "data:image/png;base64,... (or jpeg, webp, gif).", param, "invalid_image_url")
    tasks = {i: asyncio.ensure_future(fetcher.fetch(i.url, i.param, MAX_IMAGE_BYTES))
             for i in remote}
    try:
        await asyncio.gather(*tasks.values())
    finally:
        for t in tasks.values():
            t.cancel()
    images = tuple(tasks[i].result() if isinstance(i, RemoteImage) else i for i in gen.images)
    return msgspec.structs.replace(gen, images=images)
