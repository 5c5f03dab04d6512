"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from supervisor.api import lifecycle
from supervisor.api.render import shapes
from supervisor.api.output import Output, Part
from supervisor.api.parse.validation import parse_completion_request
from supervisor.http.errors import read_json


@dataclass
class CompletionShapes:
    """The objects of one text completion, streamed or whole."""
    id: str
    created: int
    model: str
    logprobs: bool = False
    sent: int = 0  # characters streamed so far (logprobs' text_offset)

    def first_chunk(self):
        return None  # legacy completions have no role chunk

    def chunks(self, part: Part) -> list[dict]:
        if not (part.text or part.logprobs):
            return []
        logprobs = shapes.text_logprobs(part.logprobs, self.sent) if self.logprobs else None
        self.sent += len(part.text)
        return [shapes.completion_chunk(self.id, self.created, self.model, part.text,
                                        logprobs=logprobs)]

    def final_chunk(self, finish_reason):
        return shapes.completion_chunk(self.id, self.created, self.model, "", finish_reason)

    def usage_chunk(self, usage):
        return shapes.completion_usage_chunk(self.id, self.created, self.model, usage)

    def body(self, output: Output, finish_reason, usage):
        logprobs = shapes.text_logprobs(output.logprobs) if self.logprobs else None
        return shapes.text_completion(self.id, self.created, self.model, output.content,
                                      finish_reason, usage, logprobs=logprobs)


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await read_json(request))
    return await lifecycle.run(request, parsed, lambda model, created: CompletionShapes(
        shapes.new_completion_id(), created, model, parsed.logprobs is not None))
