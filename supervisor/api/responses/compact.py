"""POST /v1/responses/compact: a conversation in, its compacted form out (OpenAI's
CompactResponseMethodPublicBody → CompactResource).

The body is a Responses request (`model`, `input` and/or `previous_response_id`,
`instructions`, `prompt_cache_key`; tools and the other fields are read the same way and
otherwise unused). The output is what the client sends as the start of its next input,
as OpenAI's is: the user messages of the conversation, word for word (the latest of
them, up to about a third of the model's window in characters), then one `compaction`
item whose sealed content (seal.py) holds the model's summary of everything
(summary.py). A compaction item in the input stands for what it summarised: it is
expanded before summarising, and the new summary covers it. Nothing is stored.

(Before this route, the path was taken for a response id: a 405.)
"""

from __future__ import annotations

import time

from aiohttp import web

from supervisor.api.responses import seal
from supervisor.api.responses.builder import usage
from supervisor.api.responses.items import new_id, text_of
from supervisor.api.responses.request import parse_side_request
from supervisor.api.responses.routes import RESPONSES, conversation, needs_store
from supervisor.api.responses.summary import summarise
from supervisor.http.errors import APIError, read_json
from supervisor.keys import POOL


def kept_user_messages(items: list[dict], budget: int) -> list[dict]:
    """The user messages of `items`, the latest first until `budget` characters, in
    their order."""
    kept, used = [], 0
    for item in reversed(items):
        if item["type"] == "message" and item["role"] == "user":
            used += len(text_of(item))
            if used > budget:
                break
            kept.append(item)
    return kept[::-1]


@needs_store
async def compact(request: web.Request) -> web.Response:
    req = parse_side_request(await read_json(request))
    runner = await request.app[POOL].get(req.model)
    items = await conversation(request.app[RESPONSES], req)
    if not items:
        raise APIError.bad_request("Nothing to compact: give `input` or "
                                   "`previous_response_id`.", "input")
    sealer = request.app[seal.SEALER]
    summary, done = await summarise(request, runner, req, seal.expand(items, sealer))
    output = kept_user_messages(items, runner.context_length or 4096)
    output.append(sealer.item(summary))
    return web.json_response({
        "id": new_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
        "output": output,
        "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)})


def setup(app: web.Application) -> None:
    seal.setup(app)
    app.router.add_post("/v1/responses/compact", compact)
