"""A recording proxy between a coding agent's CLI and mlxd: it passes every request through
unchanged, streams the answer back as it comes, and keeps each exchange on the paths it
watches, so a test sees what the agent sent mlxd and what mlxd answered."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer


@dataclass
class Exchange:
    path: str
    request: dict
    status: int
    body: bytes

    def events(self) -> list[dict]:
        """The answer's server-sent events' JSON data (not `[DONE]`)."""
        return [json.loads(line[6:]) for line in self.body.decode().splitlines()
                if line.startswith("data: {")]

    def error(self) -> dict:
        """A refused request's error object (the envelope's `error`)."""
        return json.loads(self.body)["error"]


@dataclass
class Recorder:
    upstream: str                     # mlxd's base URL
    paths: tuple[str, ...]            # the request paths whose exchanges are kept
    exchanges: list[Exchange] = field(default_factory=list)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length")}
        async with ClientSession() as session, session.request(
                request.method, self.upstream + request.path_qs, data=body,
                headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            answer = b""
            async for chunk in up.content.iter_any():
                answer += chunk
                await out.write(chunk)
            await out.write_eof()
        if request.path in self.paths and request.method == "POST":  # (not a WebSocket's GET)
            self.exchanges.append(Exchange(request.path, json.loads(body), up.status, answer))
        return out

    @contextlib.asynccontextmanager
    async def serving(self):
        """The proxy listening on a free local port, for the `async with`: its base URL."""
        app = web.Application(client_max_size=2**26)
        app.router.add_route("*", "/{path:.*}", self.forward)
        async with TestServer(app, host="127.0.0.1") as proxy:
            yield str(proxy.make_url("")).rstrip("/")
