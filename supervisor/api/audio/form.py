"""A multipart/form-data body (OpenAI's audio uploads) read with limits.

aiohttp's multipart reader streams the body past the app's `client_max_size`, so the
limits are here: the file part at most `max_file_bytes` (a 413 as soon as it is passed,
not after reading it all), each other field at most FIELD_LIMIT bytes of UTF-8, at most
MAX_FIELDS fields, the whole body within the server's body timeout (408). Repeated
fields (`timestamp_granularities[]`, `include[]`) keep every value, under their name
without the brackets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from supervisor.http.errors import BODY_TIMEOUT, APIError

FIELD_LIMIT = 64 << 10     # bytes: a prompt of a few thousand words
MAX_FIELDS = 64
_CHUNK = 1 << 16


@dataclass
class Form:
    fields: dict[str, list[str]] = field(default_factory=dict)
    file: bytes | None = None
    filename: str | None = None

    def get(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def all(self, name: str) -> list[str]:
        return self.fields.get(name, [])


async def read_form(request: web.Request, max_file_bytes: int, file_field: str = "file") -> Form:
    media = request.content_type
    if media != "multipart/form-data":
        raise APIError(415, "This route takes a multipart/form-data body (the audio file "
                            "in `file`, the other parameters as form fields).",
                       code="unsupported_media_type")
    timeout = request.app.get(BODY_TIMEOUT) if request.app is not None else None
    try:
        return await asyncio.wait_for(_read(request, max_file_bytes, file_field), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g} s.",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except (ValueError, AssertionError, UnicodeDecodeError):  # aiohttp's malformed-body errors
        raise APIError.bad_request("The multipart/form-data body could not be read.") from None


async def _read(request: web.Request, max_file_bytes: int, file_field: str) -> Form:
    form, count = Form(), 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        count += 1
        if count > MAX_FIELDS:
            raise APIError.bad_request(f"The form has more than {MAX_FIELDS} fields.")
        name = (part.name or "").removesuffix("[]")
        if name == file_field:
            if form.file is not None:
                raise APIError.bad_request(f"Send one `{file_field}`.", file_field)
            form.file = await _bounded(part, max_file_bytes, file_field)
            form.filename = part.filename
            continue
        raw = await _bounded(part, FIELD_LIMIT, name)
        form.fields.setdefault(name, []).append(raw.decode("utf-8"))
    return form


async def _bounded(part, limit: int, name: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > limit:
            what = "The audio file" if name == "file" else f"The field `{name}`"
            raise APIError(413, f"{what} is larger than this server accepts: the limit is "
                                f"{limit} bytes.", param=name, code="request_too_large")
    return bytes(data)
