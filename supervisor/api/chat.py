"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from supervisor.api import generation, shapes
from supervisor.api.validation import parse_chat_request
from supervisor.errors import read_json


@dataclass
class ChatShapes:
    """The objects of one chat completion, streamed or whole."""
    id: str
    created: int
    model: str
    include_usage: bool

    def first_chunk(self):
        return shapes.chat_first_chunk(self.id, self.created, self.model,
                                       include_usage=self.include_usage)

    def text_chunk(self, text):
        return shapes.chat_chunk(self.id, self.created, self.model, {"content": text},
                                 include_usage=self.include_usage)

    def final_chunk(self, finish_reason):
        return shapes.chat_chunk(self.id, self.created, self.model, {}, finish_reason,
                                 include_usage=self.include_usage)

    def usage_chunk(self, usage):
        return shapes.chat_usage_chunk(self.id, self.created, self.model, usage)

    def body(self, text, finish_reason, usage):
        return shapes.chat_completion(self.id, self.created, self.model, text, finish_reason, usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await read_json(request))
    return await generation.run(request, parsed, lambda model, created: ChatShapes(
        shapes.new_chat_id(), created, model, parsed.include_usage))
