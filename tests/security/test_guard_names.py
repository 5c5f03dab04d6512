"""The guard's pure judgements (supervisor/http/guard.py), one case at each edge: which
bound addresses are loopback (anything else needs a key to start), the name a Host
header carries, the CORS answer to a request that sent no Origin, and the one scheme
that carries a key."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from supervisor.http.guard import Guard, host_name, is_loopback_host


@pytest.mark.parametrize("host,loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
    ("0.0.0.0", False), ("192.168.1.2", False), ("::", False),
    ("example.com", False), ("myhost.local", False), ("localhost.evil.example", False),
])
def test_which_addresses_are_loopback(host, loopback):
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("header,name", [
    ("Example.COM", "example.com"), ("localhost:8080", "localhost"), ("[::1]:8080", "::1"),
    ("[::1]", "::1"), ("::1", "::1"), ("fe80::1", "fe80::1"), (" 127.0.0.1:1 ", "127.0.0.1"),
])
def test_the_name_a_host_header_carries(header, name):
    assert host_name(header) == name


def test_no_origin_gets_no_cors_answer_even_where_any_origin_is_allowed():
    assert Guard(cors_origins=("*",)).cors_origin(None) is None
    assert Guard(cors_origins=("*",)).cors_origin("https://a.example") == "*"
    assert Guard().cors_origin("https://a.example") is None


@pytest.mark.parametrize("header,ok", [
    ("Bearer k", True), ("bearer k", True), ("Bearer  k ", True),
    ("Basic k", False), ("Apikey k", False), ("Bearer", False), ("k", False),
])
def test_only_a_bearer_scheme_carries_the_key(header, ok):
    request = make_mocked_request("GET", "/v1/models", headers={"Authorization": header})
    assert Guard(keys=("k",)).key_ok(request) is ok
