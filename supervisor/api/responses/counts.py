"""POST /v1/responses/input_tokens: how many tokens a Responses request's input is
(OpenAI's TokenCountsBody → TokenCountsResource, `client.responses.input_tokens.count`).

The body is a Responses request without the generating fields: `model`, `input` and/or
`previous_response_id` or `conversation`, `instructions`, `tools`, `tool_choice`, `text`,
`reasoning`. The conversation is built as POST /v1/responses builds it (the stored chain
or the conversation's items, then the input, compaction items expanded), rendered by the
model's template with its tools and tokenized by the worker, as the generation would
prefill it; nothing is generated or stored. The count equals `usage.input_tokens` of the
same request made as a response.

(Before this route, the path was taken for a response id: a 405.)
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from protocol import Task
from supervisor.api import lifecycle
from supervisor.api.responses import seal
from supervisor.api.responses.items import new_id
from supervisor.api.responses.request import parse_side_request
from supervisor.api.responses.routes import RESPONSES, conversation, needs_store
from supervisor.http.errors import read_json
from supervisor.keys import CONFIG


@needs_store
async def input_tokens(request: web.Request) -> web.Response:
    req = parse_side_request(await read_json(request))
    items = seal.expand(await conversation(request.app[RESPONSES], req),
                        request.app[seal.SEALER])
    message = req.to_generate(items, request.app[CONFIG], new_id("resp"))
    counted = await lifecycle.compute(request, req.model,
                                      msgspec.structs.replace(message, task=Task.TOKENIZE),
                                      {"max_tokens": "max_output_tokens"})
    return web.json_response({"object": "response.input_tokens",
                              "input_tokens": len(counted.result.id_list())})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/responses/input_tokens", input_tokens)
