"""Worker management's domain errors and the one map to the OpenAI envelope."""

from __future__ import annotations

import pytest

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INTERNAL, INVALID_REQUEST, LOAD_FAILED
from supervisor.http.errors import APIError, api_error
from supervisor.workers import errors as werr

CASES = [
    (werr.BadRequest("top_k too large", "top_k", "integer_above_max_value"),
     400, "invalid_request_error", "top_k", "integer_above_max_value"),
    (werr.ContextTooLong("too long", "max_tokens"),
     400, "invalid_request_error", "max_tokens", "context_length_exceeded"),
    (werr.ModelNotFound("m"), 404, "invalid_request_error", "model", "model_not_found"),
    (werr.Overloaded("busy", 7.2), 503, "server_error", None, "overloaded"),
    (werr.WorkerFailed("died"), 503, "server_error", None, "worker_failed"),
    (werr.LoadFailed("bad weights"), 503, "server_error", None, "model_load_failed"),
    (werr.InsufficientMemory(3 << 30, 1 << 30), 507, "server_error", None,
     "insufficient_memory"),
    (werr.RequestTimeout("too slow"), 504, "server_error", None, "timeout"),
    (werr.Internal(), 500, "server_error", None, None),
]


@pytest.mark.parametrize("err,status,type_,param,code", CASES,
                         ids=[type(c[0]).__name__ for c in CASES])
def test_each_domain_error_has_one_status_and_envelope(err, status, type_, param, code):
    api = api_error(err)
    assert isinstance(api, APIError) and api.status == status
    body = api.to_envelope()["error"]
    assert (body["type"], body["param"], body["code"]) == (type_, param, code)
    assert body["message"]  # never empty, even for a bare Internal()
    if isinstance(err, (werr.Overloaded, werr.WorkerFailed)):
        assert int(api.headers["Retry-After"]) >= 1  # retryable: the SDKs retry on it
    if isinstance(err, werr.LoadFailed):
        assert "Retry-After" not in api.headers  # retrying would load the same bad files
    if isinstance(err, werr.Overloaded):
        assert api.headers["Retry-After"] == "8"  # whole seconds, rounded up
    if isinstance(err, werr.InsufficientMemory):
        assert "3.0 GiB" in body["message"] and "1.0 GiB" in body["message"]


def test_every_domain_error_class_is_mapped():
    classes = {c for c in vars(werr).values()
               if isinstance(c, type) and issubclass(c, werr.WorkerError) and c is not werr.WorkerError}
    assert classes == {type(c[0]) for c in CASES}


@pytest.mark.parametrize("code,cls,status", [
    (CONTEXT_LENGTH_EXCEEDED, werr.ContextTooLong, 400), (INVALID_REQUEST, werr.BadRequest, 400),
    (LOAD_FAILED, werr.LoadFailed, 503), (INTERNAL, werr.Internal, 500)])
def test_worker_error_codes_become_domain_errors(code, cls, status):
    err = werr.from_worker(code, "said by the worker", "response_format")
    assert type(err) is cls and err.message == "said by the worker"
    assert api_error(err).status == status


def test_an_api_error_passes_through_and_anything_else_is_a_generic_500():
    e = APIError.bad_request("x", "y")
    assert api_error(e) is e
    other = api_error(RuntimeError("secret detail"))
    assert other.status == 500 and "secret" not in other.message
