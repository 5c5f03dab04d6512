"""Questions the supervisor asks a worker and waits for (its status, `mlxctl cache`):
each message carries a query id, and the worker's answer (a Status or CacheReply) the
same id. A worker that ends leaves every open question failed, not waiting forever."""

from __future__ import annotations

import asyncio
from typing import Callable

from supervisor.workers.errors import WorkerFailed


class Queries:
    def __init__(self):
        self._open: dict[int, asyncio.Future] = {}
        self._qid = 0

    def __bool__(self) -> bool:
        return bool(self._open)

    async def ask(self, send: Callable, make: Callable, timeout: float):
        """`send(make(qid))`, then the answer with that qid (asyncio.TimeoutError past
        `timeout`)."""
        self._qid += 1
        qid = self._qid
        fut = asyncio.get_running_loop().create_future()
        self._open[qid] = fut
        send(make(qid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._open.pop(qid, None)

    def answer(self, msg) -> None:
        fut = self._open.pop(msg.qid, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_all(self) -> None:
        """The worker stopped: every open question ends with that."""
        for fut in self._open.values():
            if not fut.done():
                fut.set_exception(WorkerFailed("The worker stopped."))
        self._open.clear()
