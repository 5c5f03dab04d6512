"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from aiohttp import web

from supervisor.api import generation, shapes
from supervisor.api.validation import parse_completion_request
from supervisor.errors import read_json


class CompletionFlavor:
    null_usage = False
    id_prefix = "cmpl"

    def first_chunk(self, rid, created, model):
        return None  # legacy completions have no role chunk

    def text_chunk(self, rid, created, model, text):
        return shapes.completion_chunk(rid, created, model, text)

    def final_chunk(self, rid, created, model, finish_reason):
        return shapes.completion_chunk(rid, created, model, "", finish_reason)

    def usage_chunk(self, rid, created, model, usage):
        return shapes.completion_usage_chunk(rid, created, model, usage)

    def body(self, rid, created, model, text, finish_reason, usage):
        return shapes.text_completion(rid, created, model, text, finish_reason, usage)


FLAVOR = CompletionFlavor()


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await read_json(request))
    return await generation.run(request, parsed, FLAVOR)
