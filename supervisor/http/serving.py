"""The listening side: the socket, its connections, and the limits that keep slow and
idle clients from holding the server.

aiohttp's `run_app` gives no handle on its connections, so this runs the app the way
`run_app` does (an AppRunner with signal handling, one TCP site, cleanup on exit) and adds:
- a header deadline: aiohttp closes a connection that has no request in progress when its
  keep-alive timer fires, and arms that timer when the connection opens and after every
  response; `--header-timeout` is that timer, so a client that trickles its headers (a
  slowloris) or holds a connection idle is dropped after it;
- a body deadline: `read_json` waits at most `--body-timeout` for a body (http/errors.py);
- a connection cap (`--max-connections`): at the cap, a new connection first closes the
  longest-idle one (no request in progress); with none idle it is closed itself. So
  hundreds of idle sockets cannot keep `/health` or a short request from being served.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from aiohttp import web

log = logging.getLogger("mlxd.http")

BUSY = web.AppKey("mlxd_busy_connections", collections.Counter)


@web.middleware
async def busy_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Marks a connection busy while one of its requests runs (streams included)."""
    busy = request.app[BUSY]
    conn = request.protocol
    busy[conn] += 1
    try:
        return await handler(request)
    finally:
        busy[conn] -= 1
        if busy[conn] <= 0:
            del busy[conn]


class ConnectionCap:
    """At most `limit` open connections; see the module docstring."""

    def __init__(self, limit: int, busy: collections.Counter):
        self.limit = limit
        self.busy = busy
        self.open: collections.OrderedDict = collections.OrderedDict()  # oldest first
        self.refused = 0
        self.closed_idle = 0

    def attach(self, server) -> None:
        """Wrap the aiohttp Server's connection bookkeeping (its public methods)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self.open[handler] = transport
            self.admit(handler)

        def connection_lost(handler, exc) -> None:
            self.open.pop(handler, None)
            self.busy.pop(handler, None)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def admit(self, new) -> None:
        if not self.limit or len(self.open) <= self.limit:
            return
        for handler in list(self.open):
            if len(self.open) <= self.limit:
                return
            if handler is not new and handler not in self.busy:
                self.closed_idle += 1
                self._close(handler)
        if len(self.open) > self.limit:  # every other connection is serving a request
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("connection limit (%d) reached with every connection busy: "
                            "refused %d so far", self.limit, self.refused)
            self._close(new)

    def _close(self, handler) -> None:
        self.open.pop(handler, None)
        handler.force_close()


def install(app: web.Application) -> None:
    app[BUSY] = collections.Counter()
    app.middlewares.insert(0, busy_middleware)


def run(app: web.Application, config) -> None:
    """Serve `app` until SIGTERM/SIGINT, then clean up, as `run_app` does: only the main
    task is cancelled first, so its cleanup (the app's shutdown hooks: the drain) runs
    while request handlers still stream; what is left is cancelled after."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, config))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():  # (done: it raised during startup, e.g. SystemExit(2))
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in rest:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()


async def _serve(app: web.Application, config) -> None:
    # aiohttp's shutdown_timeout is its wait for handlers after our drain has already
    # cancelled what was left (app._drain_then_cancel): a cancel's grace is enough.
    runner = web.AppRunner(app, handle_signals=True, access_log=None,
                           handler_cancellation=True, shutdown_timeout=config.cancel_grace + 5,
                           keepalive_timeout=config.header_timeout)
    await runner.setup()
    ConnectionCap(config.max_connections, app[BUSY]).attach(runner.server)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()
