"""Counts one request may ask for (supervisor/api/fields/limits.py): at the limit a request
parses, one over it is a 400 naming the parameter and the limit, on every surface."""

from __future__ import annotations

import pytest

from supervisor.api.messages.request import parse_messages_request
from supervisor.api.fields import limits
from supervisor.api.chat.request import parse_chat_request
from supervisor.api.responses.request import parse_responses_request
from supervisor.http.errors import APIError

MSG = {"role": "user", "content": "x"}


def tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


CASES = [
    ("chat messages", lambda n: parse_chat_request({"model": "m", "messages": [MSG] * n}),
     "messages", limits.MAX_MESSAGES),
    ("chat tools", lambda n: parse_chat_request({"model": "m", "messages": [MSG],
                                                 "tools": tools(n)}),
     "tools", limits.MAX_TOOLS),
    ("logit_bias", lambda n: parse_chat_request({"model": "m", "messages": [MSG],
                                                 "logit_bias": {str(i): 1 for i in range(n)}}),
     "logit_bias", limits.MAX_LOGIT_BIAS),
    ("metadata", lambda n: parse_chat_request({"model": "m", "messages": [MSG],
                                               "metadata": {f"k{i}": "v" for i in range(n)}}),
     "metadata", limits.MAX_METADATA),
    ("responses input", lambda n: parse_responses_request({"model": "m", "input": [
        {"role": "user", "content": "x"}] * n}), "input", limits.MAX_MESSAGES),
    ("anthropic messages", lambda n: parse_messages_request(
        {"model": "m", "max_tokens": 1, "messages": [MSG] * n}), "messages", limits.MAX_MESSAGES),
    ("anthropic tools", lambda n: parse_messages_request(
        {"model": "m", "max_tokens": 1, "messages": [MSG], "tools": [
            {"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(n)]}),
     "tools", limits.MAX_TOOLS),
]


def test_stop_strings_have_a_length_limit():
    ok = "x" * limits.MAX_STOP_CHARS
    parse_chat_request({"model": "m", "messages": [MSG], "stop": [ok]})
    for parse, param in ((lambda s: parse_chat_request({"model": "m", "messages": [MSG],
                                                         "stop": s}), "stop"),
                         (lambda s: parse_chat_request({"model": "m", "messages": [MSG],
                                                         "stop": ["a", s]}), "stop[1]"),
                         (lambda s: parse_messages_request({"model": "m", "max_tokens": 1,
                                                             "messages": [MSG],
                                                             "stop_sequences": [s]}),
                          "stop_sequences[0]")):
        with pytest.raises(APIError) as e:
            parse(ok + "x")
        assert e.value.param == param and e.value.code == "string_above_max_length"


@pytest.mark.parametrize("what,parse,param,limit", CASES, ids=[c[0] for c in CASES])
def test_at_the_limit_parses_one_over_is_refused(what, parse, param, limit):
    parse(limit)
    with pytest.raises(APIError) as e:
        parse(limit + 1)
    err = e.value
    assert err.status == 400 and err.param == param and err.code == "array_above_max_length"
    assert f"maximum length {limit}" in err.message and str(limit + 1) in err.message
