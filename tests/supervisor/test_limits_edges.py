"""What a request must satisfy before it queues (supervisor/workers/limits.py), at each
limit exactly: the limit itself passes and one past it is refused, naming the client's
parameter; and a request that could not be sent is the client's 400 when a value could
not be encoded, a 500 otherwise."""

from __future__ import annotations

import pytest

from protocol import EncodeError
from supervisor.workers.errors import BadRequest, ContextTooLong, Internal
from supervisor.workers.limits import check_limits, unsendable
from tests.generates import generate

CTX, VOCAB = 128, 1000
ASKED = {"max_tokens": "max_output_tokens"}  # the Responses API's name


def limits(**fields):
    check_limits(generate(**fields).sampling, ASKED, CTX, VOCAB)


def test_each_limit_itself_passes():
    limits(max_tokens=CTX, top_k=VOCAB, logit_bias=[[0, 1.0], [VOCAB - 1, -1.0]])
    limits(max_tokens=1, top_k=1, logit_bias=[[5, 1.0]])  # and what is well inside
    check_limits(generate(max_tokens=10 ** 6).sampling, {}, None, None)  # not known yet


@pytest.mark.parametrize("fields,error,param", [
    (dict(max_tokens=CTX + 1), ContextTooLong, "max_output_tokens"),
    (dict(top_k=VOCAB + 1), BadRequest, "top_k"),
    (dict(logit_bias=[[VOCAB, 1.0]]), BadRequest, "logit_bias"),
    (dict(logit_bias=[[VOCAB + 5, 1.0]]), BadRequest, "logit_bias"),
    (dict(logit_bias=[[-1, 1.0]]), BadRequest, "logit_bias"),
])
def test_one_past_each_limit_is_refused_naming_the_clients_parameter(fields, error, param):
    with pytest.raises(error) as err:
        limits(**fields)
    assert err.value.param == param
    if param == "logit_bias":
        assert f"has {VOCAB} tokens (ids 0 to {VOCAB - 1})" in str(err.value)


def test_a_request_that_cannot_be_sent():
    e = unsendable(EncodeError("generate.sampling.seed: out of range", "seed"))
    assert isinstance(e, BadRequest) and e.param == "seed" and "out of range" in str(e)
    assert isinstance(unsendable(ConnectionResetError("gone")), Internal)
