"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from supervisor.api import generation, shapes
from supervisor.api.validation import parse_completion_request
from supervisor.errors import read_json


@dataclass
class CompletionShapes:
    """The objects of one text completion, streamed or whole."""
    id: str
    created: int
    model: str

    def first_chunk(self):
        return None  # legacy completions have no role chunk

    def text_chunk(self, text):
        return shapes.completion_chunk(self.id, self.created, self.model, text)

    def final_chunk(self, finish_reason):
        return shapes.completion_chunk(self.id, self.created, self.model, "", finish_reason)

    def usage_chunk(self, usage):
        return shapes.completion_usage_chunk(self.id, self.created, self.model, usage)

    def body(self, text, finish_reason, usage):
        return shapes.text_completion(self.id, self.created, self.model, text, finish_reason, usage)


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await read_json(request))
    return await generation.run(request, parsed, lambda model, created: CompletionShapes(
        shapes.new_completion_id(), created, model))
