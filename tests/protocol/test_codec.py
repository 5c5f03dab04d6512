"""The wire format (golden bytes) and the codec's refusal of anything malformed."""

from __future__ import annotations

import dataclasses
import os
import stat

import msgpack
import pytest

from protocol import (PROTOCOL_VERSION, Cancel, Delta, Done, Error, Generate, Heartbeat,
                      ProtocolError, Ready, Shutdown, Started, Status, StatusRequest,
                      ToolCall, decode_down, decode_up, encode, pack_floats, pack_ids,
                      unpack_floats, unpack_ids)
from protocol.messages import DOWN, UP
from protocol.sockets import Endpoints, make_runtime_dir, remove_runtime_dir

# A msgpack map: fixmap header, then key/value pairs ("v", 1), ("type", ...), fields in
# declaration order. Pinned byte for byte: a change here breaks mixed-version peers.
GOLDEN = [
    (Cancel(rid="r1"), b"\x83\xa1v\x01\xa4type\xa6cancel\xa3rid\xa2r1"),
    (Shutdown(), b"\x82\xa1v\x01\xa4type\xa8shutdown"),
    (Delta(epoch=2, rid="r1", text="h\u00e9", token_ids=pack_ids([1, 258])),
     b"\x8c\xa1v\x01\xa4type\xa5delta\xa5epoch\x02\xa3rid\xa2r1\xa4text\xa3h\xc3\xa9"
     b"\xa9token_ids\xc4\x08\x01\x00\x00\x00\x02\x01\x00\x00"
     b"\xa9reasoning\xa0\xaatool_calls\x90\xa8logprobs\xc4\x00\xa7top_ids\xc4\x00"
     b"\xactop_logprobs\xc4\x00\xabtoken_bytes\x90"),
    (Done(epoch=2, rid="r1", finish_reason="length", prompt_tokens=3, completion_tokens=4),
     b"\x89\xa1v\x01\xa4type\xa4done\xa5epoch\x02\xa3rid\xa2r1\xadfinish_reason\xa6length"
     b"\xadprompt_tokens\x03\xb1completion_tokens\x04\xadcached_tokens\x00"
     b"\xb0reasoning_tokens\x00"),
]

# The same two messages as an older peer (before reasoning, tool calls and logprobs)
# sent them: the fields added since decode to their defaults.
OLD_WIRE = [
    (b"\x86\xa1v\x01\xa4type\xa5delta\xa5epoch\x02\xa3rid\xa2r1\xa4text\xa3h\xc3\xa9"
     b"\xa9token_ids\xc4\x08\x01\x00\x00\x00\x02\x01\x00\x00", GOLDEN[2][0]),
    (b"\x88\xa1v\x01\xa4type\xa4done\xa5epoch\x02\xa3rid\xa2r1\xadfinish_reason\xa6length"
     b"\xadprompt_tokens\x03\xb1completion_tokens\x04\xadcached_tokens\x00", GOLDEN[3][0]),
]


@pytest.mark.parametrize("wire,msg", OLD_WIRE, ids=["Delta", "Done"])
def test_an_older_peers_messages_still_decode(wire, msg):
    assert decode_up(wire) == msg


def test_tool_calls_and_logprobs_travel_packed():
    call = ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}')
    d = Delta(epoch=1, rid="a", text="", token_ids=pack_ids([7, 8]), reasoning="hm",
              tool_calls=[call.to_wire()], logprobs=pack_floats([-0.5, -1.25]),
              top_ids=pack_ids([7, 3, 8, 2]), top_logprobs=pack_floats([-0.5, -2.0, -1.25, -3.0]),
              token_bytes=[b"a", b"b", b"c", b"\xe2", b"d", b"e"])
    back = decode_up(encode(d))
    assert back == d
    assert [ToolCall.from_wire(c) for c in back.tool_calls] == [call]
    assert unpack_floats(back.logprobs) == [-0.5, -1.25]
    assert unpack_ids(back.top_ids) == [7, 3, 8, 2]
    with pytest.raises(ValueError):
        ToolCall.from_wire([0, "id", "name"])


@pytest.mark.parametrize("msg,wire", GOLDEN, ids=lambda x: type(x).__name__)
def test_golden_bytes(msg, wire):
    assert encode(msg) == wire
    decode = decode_up if type(msg) in UP else decode_down
    assert decode(wire) == msg


def test_every_message_round_trips_with_version():
    samples = [
        Generate(rid="a", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                 temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, seed=3,
                 repetition_penalty=1.1, stop=["x"], template_kwargs={"k": True}),
        Generate(rid="b", prompt_ids=pack_ids([1, 2, 3])),
        Cancel(rid="a"), StatusRequest(qid=7), Shutdown(),
        Ready(epoch=1, model="m", context_length=4096, pid=9, slots=1, random_weights=True),
        Started(epoch=1, rid="a", prompt_tokens=10, cached_tokens=2),
        Delta(epoch=1, rid="a", text="x", token_ids=pack_ids([5])),
        Done(epoch=1, rid="a", finish_reason="stop"),
        Error(epoch=1, code="context_length_exceeded", message="too long", rid="a", param="messages"),
        Status(epoch=1, qid=7, state="busy", active=["a"], waiting=["b"], steps=3),
        Heartbeat(epoch=1, state="ready", steps=4),
    ]
    assert {type(m) for m in samples} == set(DOWN) | set(UP)
    for m in samples:
        raw = encode(m)
        assert msgpack.unpackb(raw)["v"] == PROTOCOL_VERSION
        assert (decode_up if type(m) in UP else decode_down)(raw) == m


def test_directions_are_separate():
    # "status" is a type in both directions; each side only decodes its own.
    with pytest.raises(ProtocolError):
        decode_up(encode(Cancel(rid="a")))
    with pytest.raises(ProtocolError):
        decode_down(encode(Heartbeat(epoch=1, state="ready")))


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"garbage", b"\x93\x01\x02\x03",              # not msgpack / not a map
    msgpack.packb({"type": "cancel", "rid": "a"}),              # no version
    msgpack.packb({"v": 99, "type": "cancel", "rid": "a"}),     # wrong version
    msgpack.packb({"v": 1, "type": "explode"}),                 # unknown type
    msgpack.packb({"v": 1, "type": "cancel"}),                  # missing field
    msgpack.packb({"v": 1, "type": "cancel", "rid": 5}),        # wrong type
    msgpack.packb({"v": 1, "type": "generate", "rid": "a", "max_tokens": "5"}),
    msgpack.packb({"v": 1, "type": "generate", "rid": "a", "max_tokens": True}),  # bool ≠ int
    msgpack.packb({"v": 1, "type": "generate", "rid": None}),   # null where not nullable
    msgpack.packb({1: 2}),                                      # non-string keys
])
def test_malformed_frames_are_typed_errors(frame):
    with pytest.raises(ProtocolError):
        decode_down(frame)


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    raw = msgpack.packb({"v": 1, "type": "generate", "rid": "a", "future_field": [1, 2]})
    g = decode_down(raw)
    assert g == Generate(rid="a") and g.stop == [] and g.max_tokens is None


def test_new_fields_have_defaults_at_the_end():
    # The compatibility rule: after the required fields, every field has a default.
    for cls in DOWN + UP:
        seen_default = False
        for f in dataclasses.fields(cls):
            has_default = (f.default is not dataclasses.MISSING
                           or f.default_factory is not dataclasses.MISSING)
            assert has_default or not seen_default, f"{cls.__name__}.{f.name}"
            seen_default |= has_default


def test_pack_ids_round_trip_and_size():
    ids = [0, 1, 255, 65_536, 151_000]
    assert unpack_ids(pack_ids(ids)) == ids
    assert len(pack_ids(ids)) == 4 * len(ids)
    raw = encode(Delta(epoch=1, rid="a", text="", token_ids=pack_ids(range(100))))
    assert isinstance(msgpack.unpackb(raw)["token_ids"], bytes)  # one bin, not 100 ints
    assert len(raw) < 4 * 100 + 128  # the ids, plus the names of the fields


def test_runtime_dir_is_private_and_paths_fit_af_unix():
    path = make_runtime_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        ep = Endpoints.for_worker(path, "w12345-some-model-3")
        assert ep.commands.startswith("ipc://") and len(ep.events) - len("ipc://") < 104
        with pytest.raises(ValueError):
            Endpoints.for_worker(path, "x" * 200)
    finally:
        remove_runtime_dir(path)
    assert not path.exists()


@pytest.mark.parametrize("kwargs,field", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"stop": ["ok", "\udfff"]}, "stop"),
    ({"max_tokens": 2 ** 64}, "max_tokens"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"logit_bias": [[2 ** 70, 1.0]]}, "logit_bias"),
    ({"json_schema": {"default": 2 ** 64}}, "json_schema"),
    ({"template_kwargs": {"k": object()}}, "template_kwargs"),
])
def test_values_that_cannot_travel_are_typed_errors_naming_the_field(kwargs, field):
    from protocol import EncodeError

    with pytest.raises(EncodeError) as e:
        encode(Generate(rid="a", **kwargs))
    assert e.value.field == field and f"generate.{field}" in str(e.value)
    assert isinstance(e.value, ProtocolError)  # one family of protocol errors
