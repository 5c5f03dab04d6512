"""A worker's Error codes as the supervisor's domain errors (supervisor/workers/errors.py
`from_worker`): a context overflow names the parameter the worker named, or `messages`
when it named none; each other code keeps its kind."""

from __future__ import annotations

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INTERNAL, INVALID_REQUEST, LOAD_FAILED
from supervisor.workers.errors import BadRequest, ContextTooLong, Internal, LoadFailed, from_worker


def test_a_context_overflow_names_the_workers_parameter_or_messages():
    e = from_worker(CONTEXT_LENGTH_EXCEEDED, "too long")
    assert isinstance(e, ContextTooLong) and e.param == "messages"
    assert from_worker(CONTEXT_LENGTH_EXCEEDED, "too long", "prompt").param == "prompt"


def test_each_other_code_keeps_its_kind():
    e = from_worker(INVALID_REQUEST, "bad voice", "voice")
    assert type(e) is BadRequest and e.param == "voice" and e.code is None
    assert type(from_worker(LOAD_FAILED, "no weights")) is LoadFailed
    assert type(from_worker(INTERNAL, "boom")) is Internal
