"""What can go wrong in worker management, in its own terms.

The pool, runners and request handles raise these; they know nothing of HTTP. The API
layer maps each to its surface's envelope in one place (supervisor/http/errors.py
`api_error`), and the admin API reuses that map. Every message is safe to show to a
client: it names models and limits, never prompt text or a traceback.
"""

from __future__ import annotations

from typing import Optional

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, LOAD_FAILED


class WorkerError(Exception):
    """Base of every domain error; `message` is what a client may read."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(WorkerError):
    """The request cannot be served by this model as it stands (a limit, a value that
    cannot travel, the worker's own refusal): the client must change it."""

    def __init__(self, message: str, param: Optional[str] = None,
                 code: Optional[str] = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextTooLong(BadRequest):
    def __init__(self, message: str, param: Optional[str] = "messages"):
        super().__init__(message, param, CONTEXT_LENGTH_EXCEEDED)


class ModelNotFound(WorkerError):
    def __init__(self, model: str):
        super().__init__(f"model {model!r} not found")
        self.model = model


class Overloaded(WorkerError):
    """Too busy now (queue full, waited too long, a reader too slow): retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerFailed(WorkerError):
    """The worker died, was stopped or is being replaced under the request: a retry on
    the next worker may well succeed."""


class LoadFailed(WorkerError):
    """The model could not be loaded (its worker said why)."""


class InsufficientMemory(WorkerError):
    def __init__(self, need_bytes: int, free_bytes: int):
        gib = 1024 ** 3
        super().__init__(f"Not enough memory to load the model: it needs about "
                         f"{need_bytes / gib:.1f} GiB and {free_bytes / gib:.1f} GiB is "
                         f"available.")
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes


class RequestTimeout(WorkerError):
    """The request ran past the server's request timeout and was cancelled."""


class Internal(WorkerError):
    """A bug: the message is generic unless one safe to show is given."""

    def __init__(self, message: str = ""):
        super().__init__(message)


def from_worker(code: str, message: str, param: Optional[str] = None) -> WorkerError:
    """A worker's `Error` event (protocol.messages codes; its message is safe to show by
    the protocol's contract) as a domain error."""
    if code == CONTEXT_LENGTH_EXCEEDED:
        return ContextTooLong(message, param or "messages")
    if code == INVALID_REQUEST:
        return BadRequest(message, param, None)
    if code == LOAD_FAILED:
        return LoadFailed(message)
    return Internal(message)
