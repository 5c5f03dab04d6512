"""The worker's typed errors, as supervisor/workers/errors.py holds the supervisor's.

Three kinds, each answered differently by the process (worker/__main__.py, the schedulers):
- `RequestError`: one request is refused (bad input, too long, a grammar that will not
  compile). The worker answers that request's `Error` and goes on serving the others.
- `WorkerBroken`: MLX cannot run a step any more in this process (the allocator failed,
  a kernel raised). Every request in flight gets its `Error`, and the process exits with
  EXIT_BROKEN so the supervisor starts a fresh one.
- `LoadError`: the model cannot be loaded (missing, unreadable, a kind the worker cannot
  serve). The worker says `LOAD_FAILED` with the message and exits before serving.
Every message is safe to show to a client: it names the request's fields, never its text.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the worker refuses; the message is safe to show to the client."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 prompt_tokens: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.prompt_tokens = prompt_tokens


class WorkerBroken(Exception):
    """MLX cannot run a step any more in this process: only a fresh worker can serve."""


class LoadError(Exception):
    """A load failure with a message safe to show to the client."""
