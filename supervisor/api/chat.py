"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from supervisor.api import lifecycle
from supervisor.api.render import shapes
from supervisor.api.output import Output, Part
from supervisor.api.parse.validation import parse_chat_request
from supervisor.http.errors import read_json


@dataclass
class ChatShapes:
    """The objects of one chat completion, streamed or whole."""
    id: str
    created: int
    model: str
    include_usage: bool
    logprobs: bool = False

    def _chunk(self, delta: dict, logprobs=None) -> dict:
        return shapes.chat_chunk(self.id, self.created, self.model, delta,
                                 include_usage=self.include_usage, logprobs=logprobs)

    def first_chunk(self):
        return shapes.chat_first_chunk(self.id, self.created, self.model,
                                       include_usage=self.include_usage)

    def chunks(self, part: Part) -> list[dict]:
        """Reasoning, answer text (with the batch's logprobs) and tool calls, in the order
        the model produced them within one batch (reasoning comes before the answer)."""
        out = []
        if part.reasoning:
            out.append(self._chunk({"reasoning_content": part.reasoning}))
        logprobs = shapes.chat_logprobs(part.logprobs) if part.logprobs else None
        if part.text or logprobs:
            out.append(self._chunk({"content": part.text}, logprobs))
        for call in part.tool_calls:
            out.extend(self._chunk(d) for d in shapes.tool_call_deltas(call))
        return out

    def final_chunk(self, finish_reason):
        return shapes.chat_chunk(self.id, self.created, self.model, {}, finish_reason,
                                 include_usage=self.include_usage)

    def usage_chunk(self, usage):
        return shapes.chat_usage_chunk(self.id, self.created, self.model, usage)

    def body(self, output: Output, finish_reason, usage):
        return shapes.chat_completion(
            self.id, self.created, self.model, output.content, finish_reason, usage,
            tool_calls=[shapes.tool_call(c) for c in output.tool_calls],
            reasoning=output.reasoning_text,
            logprobs=shapes.chat_logprobs(output.logprobs) if self.logprobs else None)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await read_json(request))
    return await lifecycle.run(request, parsed, lambda model, created: ChatShapes(
        shapes.new_chat_id(), created, model, parsed.include_usage, parsed.logprobs))
