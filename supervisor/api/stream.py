"""One request's life as every API surface sees it: submit, started, parts, done.

Chat completions, legacy completions and the Responses API differ only in how they render
(render/shapes.py, responses/builder.py); the life of the request underneath is the same,
and lives here once. `Generation` wraps the worker-management handle:

- `started()` waits for the worker to take the prompt. Failures before that keep their
  own HTTP status (400 context too long, 503 busy): nothing has been sent yet.
- `parts()` yields the output as `Part`s, several worker steps folded into one when the
  client reads slower than the model writes; with `idle`, a `None` after that many quiet
  seconds (for SSE pings). A failure mid-way raises the domain error (or APIError).
- `done` is the terminal message (finish reason and usage) once `parts()` has ended.
- `close()` is idempotent and cancels the worker's sequence if it is still running; the
  surfaces call it whenever they leave, for any reason (a client gone included).
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from protocol import Done, Started
from supervisor.api.render.output import Output, Part
from supervisor.workers.handle import RequestHandle


class Generation:
    def __init__(self, handle: RequestHandle, *, queue_timeout: float,
                 request_timeout: float, logprobs: bool = False):
        self.handle = handle
        self.queue_timeout = queue_timeout
        self.request_timeout = request_timeout
        self.logprobs = logprobs
        self._deadline: Optional[float] = None

    async def started(self) -> Started:
        msg = await self.handle.started(self.queue_timeout)
        self._deadline = time.monotonic() + self.request_timeout
        return msg

    async def parts(self, idle: float | None = None) -> AsyncIterator[Part | None]:
        async for batch in self.batches(idle):
            yield Part.of(batch, self.logprobs) if batch else None

    async def batches(self, idle: float | None = None) -> AsyncIterator[list]:
        """The worker's step messages as they come (Deltas; a synthesis' Audio), several
        at once when the client lags; with `idle`, an empty list after quiet seconds."""
        if self._deadline is None:
            raise RuntimeError("parts() before started()")
        async for batch in self.handle.deltas(self._deadline, idle=idle):
            yield batch

    async def collect(self) -> Output:
        """The whole output, for a response that is not streamed."""
        output = Output()
        async for part in self.parts():
            output.add(part)
        return output

    @property
    def done(self) -> Done | None:
        return self.handle.done

    def close(self) -> None:
        self.handle.close()
