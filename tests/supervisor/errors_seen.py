"""How a test sees worker management's domain errors: as the client would (the HTTP map)."""

from __future__ import annotations

import contextlib

import pytest

from supervisor.http.errors import APIError, api_error
from supervisor.workers.errors import WorkerError


class Seen:
    value: APIError


@contextlib.contextmanager
def raises_api():
    """Like pytest.raises(APIError), for code that raises domain errors: `.value` is the
    APIError the HTTP layer makes of what was raised (and the domain error is `.raw`)."""
    seen = Seen()
    with pytest.raises(WorkerError) as err:
        yield seen
    seen.raw = err.value
    seen.value = api_error(err.value)
