"""POST /v1/chat/completions."""

from __future__ import annotations

from aiohttp import web

from supervisor.api import generation, shapes
from supervisor.api.validation import parse_chat_request
from supervisor.errors import read_json


class ChatFlavor:
    null_usage = True
    id_prefix = "chatcmpl"

    def first_chunk(self, rid, created, model):
        return shapes.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})

    def text_chunk(self, rid, created, model, text):
        return shapes.chat_chunk(rid, created, model, {"content": text})

    def final_chunk(self, rid, created, model, finish_reason):
        return shapes.chat_chunk(rid, created, model, {}, finish_reason)

    def usage_chunk(self, rid, created, model, usage):
        return shapes.chat_usage_chunk(rid, created, model, usage)

    def body(self, rid, created, model, text, finish_reason, usage):
        return shapes.chat_completion(rid, created, model, text, finish_reason, usage)


FLAVOR = ChatFlavor()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await read_json(request))
    return await generation.run(request, parsed, FLAVOR)
