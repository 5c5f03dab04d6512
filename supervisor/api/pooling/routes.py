"""POST /v1/embeddings (OpenAI) and POST /v1/rerank (the Jina/Cohere shape llama-server and
vLLM serve; also at /rerank and /v1/reranking... as those servers spell it).

Both run on an embedding or reranker model's worker (worker/pooling/) through the one
request lifecycle (api/lifecycle.py). A model of the wrong kind is a 400 naming `model`
(supervisor/workers/limits.py), never a generation in disguise.
"""

from __future__ import annotations

import base64
import time
import uuid

from aiohttp import web

from protocol import pack_floats, unpack_floats
from supervisor.api.lifecycle import compute
from supervisor.api.pooling.request import parse_embeddings_request, parse_rerank_request
from supervisor.http.errors import read_json


async def embeddings(request: web.Request) -> web.Response:
    parsed = parse_embeddings_request(await read_json(request))
    done = await compute(request, parsed.model, parsed.to_generate())
    data = []
    for i, row in enumerate(done.result.matrix()):
        if parsed.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
            vector = base64.b64encode(pack_floats(row)).decode("ascii")
        else:
            vector = row
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = done.done.prompt_tokens
    return web.json_response({"object": "list", "data": data, "model": done.model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(request: web.Request) -> web.Response:
    parsed = parse_rerank_request(await read_json(request))
    done = await compute(request, parsed.model, parsed.to_generate())
    scores = unpack_floats(done.result.data)
    # Best first; equal scores keep the documents' order, so the ranking is deterministic.
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if parsed.top_n is not None:
        order = order[:parsed.top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if parsed.return_documents:
            item["document"] = {"text": parsed.documents[i]}
        results.append(item)
    tokens = done.done.prompt_tokens
    return web.json_response({
        "id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": done.model,
        "created": int(time.time()), "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        app.router.add_post(path, rerank)
