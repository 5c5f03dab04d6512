"""The wire format (golden bytes) and the codec's refusal of anything malformed."""

from __future__ import annotations

import os
import stat

import msgpack
import msgspec
import pytest

from protocol import (PROTOCOL_VERSION, Audio, Cancel, Delta, Done, EncodeError, Error,
                      ErrorCode, FinishReason, Generate, Heartbeat, ModelKind, OutputSpec,
                      Pooled, PromptCache, ProtocolError, Ready, SamplingParams, Segment,
                      Shutdown, SpeechSpec, Started, Status, StatusRequest, Task, Tokens, ToolCall,
                      Transcript, Word, decode_down, decode_up, encode, pack_floats, pack_ids,
                      unpack_floats, unpack_ids)
from protocol.messages import (DOWN, UP, CacheCommand, CacheReply, CacheStats, SnapshotInfo,
                               SnapshotStats)
from protocol.sockets import Endpoints, make_runtime_dir, remove_runtime_dir

# A msgpack map: fixmap header, then ("type", kind), ("v", 7), then the fields in declaration
# order (nested structs as maps of their own). Pinned byte for byte: a change here breaks
# mixed-version peers, so it comes with a PROTOCOL_VERSION bump.
GOLDEN = [
    (Cancel(rid="r1"), b"\x83\xa4type\xa6cancel\xa1v\x07\xa3rid\xa2r1"),
    (Shutdown(), b"\x82\xa4type\xa8shutdown\xa1v\x07"),
    (Delta(epoch=2, rid="r1", text="h\u00e9", token_ids=pack_ids([1, 258])),
     b"\x8d\xa4type\xa5delta\xa1v\x07\xa5epoch\x02\xa3rid\xa2r1\xa4text\xa3h\xc3\xa9"
     b"\xa9token_ids\xc4\x08\x01\x00\x00\x00\x02\x01\x00\x00"
     b"\xa9reasoning\xa0\xaatool_calls\x90\xa8logprobs\xc4\x00\xa7top_ids\xc4\x00"
     b"\xactop_logprobs\xc4\x00\xabtoken_bytes\x90\xa3cut\xc0"),
    (Done(epoch=2, rid="r1", finish_reason=FinishReason.LENGTH, prompt_tokens=3,
          completion_tokens=4),
     b"\x8c\xa4type\xa4done\xa1v\x07\xa5epoch\x02\xa3rid\xa2r1\xadfinish_reason\xa6length"
     b"\xadprompt_tokens\x03\xb1completion_tokens\x04\xadcached_tokens\x00"
     b"\xb0reasoning_tokens\x00\xadstop_sequence\xc0"
     b"\xbaaccepted_prediction_tokens\x00\xbarejected_prediction_tokens\x00"),
    (Generate(rid="r1", prompt="hi",
              sampling=SamplingParams(max_tokens=2, logit_bias=((7, -1.5),)),
              output=OutputSpec(stop=("x",))),
     b"\xde\x00\x15\xa4type\xa8generate\xa1v\x07\xa3rid\xa2r1\xa8messages\xc0\xa6prompt\xa2hi"
     b"\xaaprompt_ids\xc0"
     b"\xa8sampling\x8b\xaamax_tokens\x02\xabtemperature\xc0\xa5top_p\xc0\xa5top_k\xc0"
     b"\xa5min_p\xc0\xa4seed\xc0\xb2repetition_penalty\xc0\xb0presence_penalty\xc0"
     b"\xb1frequency_penalty\xc0\xaalogit_bias\x91\x92\x07\xcb\xbf\xf8\x00\x00\x00\x00\x00\x00"
     b"\xb2max_tokens_ceiling\xc2"
     b"\xa6output\x8b\xa4stop\x91\xa1x\xa8logprobs\xc2\xactop_logprobs\x00"
     b"\xafresponse_format\xc0\xabjson_schema\xc0\xa5tools\xc0\xabtool_choice\xc0"
     b"\xadallowed_tools\xc0\xb3parallel_tool_calls\xc3\xb0reasoning_effort\xc0"
     b"\xa4echo\xc2"
     b"\xaftemplate_kwargs\xc0\xaalog_prompt\xc2"
     b"\xa5cache\x85\xa9namespace\xc0\xa7keep_as\xc0\xabresume_from\xc0\xacresume_label\xa0"
     b"\xa7repeats\x00"
     b"\xa4task\xa8generate\xa6inputs\xc0\xa9input_ids\xc0\xaadimensions\xc0"
     b"\xa6images\x90\xa5audio\xc0"
     b"\xa6speech\x86\xa8language\xc0\xa9translate\xc2\xa8segments\xc2\xa5words\xc2"
     b"\xa5voice\xc0\xa5speed\xcb?\xf0\x00\x00\x00\x00\x00\x00\xaaprediction\xc0"
     b"\xa6audios\x90\xaespecial_tokens\xc3"),
    # The prompt cache's options travel as one nested map (version 7).
    (Generate(rid="r2", prompt="hi",
              cache=PromptCache(namespace="conv", keep_as="resp_2", resume_from="key:conv",
                                resume_label="a prompt_cache_key snapshot")),
     b"\xde\x00\x15\xa4type\xa8generate\xa1v\x07\xa3rid\xa2r2\xa8messages\xc0\xa6prompt\xa2hi"
     b"\xaaprompt_ids\xc0"
     b"\xa8sampling\x8b\xaamax_tokens\xc0\xabtemperature\xc0\xa5top_p\xc0\xa5top_k\xc0"
     b"\xa5min_p\xc0\xa4seed\xc0\xb2repetition_penalty\xc0\xb0presence_penalty\xc0"
     b"\xb1frequency_penalty\xc0\xaalogit_bias\x90\xb2max_tokens_ceiling\xc2"
     b"\xa6output\x8b\xa4stop\x90\xa8logprobs\xc2\xactop_logprobs\x00"
     b"\xafresponse_format\xc0\xabjson_schema\xc0\xa5tools\xc0\xabtool_choice\xc0"
     b"\xadallowed_tools\xc0\xb3parallel_tool_calls\xc3\xb0reasoning_effort\xc0"
     b"\xa4echo\xc2"
     b"\xaftemplate_kwargs\xc0\xaalog_prompt\xc2"
     b"\xa5cache\x85\xa9namespace\xa4conv\xa7keep_as\xa6resp_2\xabresume_from\xa8key:conv"
     b"\xacresume_label\xbba prompt_cache_key snapshot\xa7repeats\x00"
     b"\xa4task\xa8generate\xa6inputs\xc0\xa9input_ids\xc0\xaadimensions\xc0"
     b"\xa6images\x90\xa5audio\xc0"
     b"\xa6speech\x86\xa8language\xc0\xa9translate\xc2\xa8segments\xc2\xa5words\xc2"
     b"\xa5voice\xc0\xa5speed\xcb?\xf0\x00\x00\x00\x00\x00\x00\xaaprediction\xc0"
     b"\xa6audios\x90\xaespecial_tokens\xc3"),
]

# Messages as an older peer of this version (before reasoning, tool calls and logprobs)
# sent them: the fields added since decode to their defaults.
OLD_WIRE = [
    (b"\x86\xa4type\xa5delta\xa1v\x07\xa5epoch\x02\xa3rid\xa2r1\xa4text\xa3h\xc3\xa9"
     b"\xa9token_ids\xc4\x08\x01\x00\x00\x00\x02\x01\x00\x00", GOLDEN[2][0]),
    (b"\x88\xa4type\xa4done\xa1v\x07\xa5epoch\x02\xa3rid\xa2r1\xadfinish_reason\xa6length"
     b"\xadprompt_tokens\x03\xb1completion_tokens\x04\xadcached_tokens\x00", GOLDEN[3][0]),
    # A Generate from before the prompt cache's options and the tasks.
    (GOLDEN[4][1].replace(b"\xde\x00\x15", b"\x8a", 1).split(b"\xa5cache")[0], GOLDEN[4][0]),
]

# Version 1's bytes (the dataclass codec's) for the same Cancel and Done: refused.
VERSION_1 = [
    b"\x83\xa1v\x01\xa4type\xa6cancel\xa3rid\xa2r1",
    b"\x89\xa1v\x01\xa4type\xa4done\xa5epoch\x02\xa3rid\xa2r1\xadfinish_reason\xa6length"
    b"\xadprompt_tokens\x03\xb1completion_tokens\x04\xadcached_tokens\x00"
    b"\xb0reasoning_tokens\x00",
]


@pytest.mark.parametrize("msg,wire", GOLDEN, ids=lambda x: type(x).__name__)
def test_golden_bytes(msg, wire):
    assert encode(msg) == wire
    decode = decode_up if type(msg) in UP else decode_down
    assert decode(wire) == msg


@pytest.mark.parametrize("wire,msg", OLD_WIRE, ids=["Delta", "Done", "Generate"])
def test_an_older_peers_messages_still_decode(wire, msg):
    assert (decode_down if isinstance(msg, Generate) else decode_up)(wire) == msg


@pytest.mark.parametrize("wire", VERSION_1, ids=["Cancel", "Done"])
def test_version_1_frames_are_refused(wire):
    with pytest.raises(ProtocolError, match="version 1, expected 7"):
        (decode_down if b"cancel" in wire else decode_up)(wire)


@pytest.mark.parametrize("old", [3, 4, 5, 6])
def test_an_older_versions_generate_is_refused(old):
    # A version-3 worker would ignore `resume` and `snapshot` and never answer a
    # CacheCommand, a version-4 one would drop `images`, a version-6 one `cache` (its
    # namespace and snapshot names): a peer of another version is refused, not half
    # understood.
    wire = GOLDEN[5][1].replace(b"\xa1v\x07", bytes([0xa1, ord("v"), old]), 1)
    with pytest.raises(ProtocolError, match=f"version {old}, expected 7"):
        decode_down(wire)


def test_tool_calls_and_logprobs_travel_packed():
    call = ToolCall(0, "call_1", "get_weather", '{"city": "Paris"}')
    d = Delta(epoch=1, rid="a", text="", token_ids=pack_ids([7, 8]), reasoning="hm",
              tool_calls=[call], logprobs=pack_floats([-0.5, -1.25]),
              top_ids=pack_ids([7, 3, 8, 2]), top_logprobs=pack_floats([-0.5, -2.0, -1.25, -3.0]),
              token_bytes=[b"a", b"b", b"c", b"\xe2", b"d", b"e"])
    raw = encode(d)
    # A call travels as the list [index, id, name, arguments]; it decodes as a ToolCall.
    assert msgpack.unpackb(raw)["tool_calls"] == [[0, "call_1", "get_weather",
                                                    '{"city": "Paris"}']]
    back = decode_up(raw)
    assert back == d and back.tool_calls == [call] and isinstance(back.tool_calls[0], ToolCall)
    assert unpack_floats(back.logprobs) == [-0.5, -1.25]
    assert unpack_ids(back.top_ids) == [7, 3, 8, 2]
    assert back.n_tokens == 2 and back.ids() == [7, 8]
    assert back.logprob_rows() == [(b"a", -0.5, [(b"b", -0.5), (b"c", -2.0)]),
                                   (b"\xe2", -1.25, [(b"d", -1.25), (b"e", -3.0)])]
    with pytest.raises(ValueError):
        ToolCall.from_wire([0, "id", "name"])


def test_enums_travel_as_their_strings_and_decode_as_members():
    done = decode_up(encode(Done(epoch=1, rid="a", finish_reason=FinishReason.TOOL_CALLS)))
    assert done.finish_reason is FinishReason.TOOL_CALLS
    assert done.finish_reason == "tool_calls" and f"{done.finish_reason}" == "tool_calls"
    err = decode_up(encode(Error(epoch=1, code=ErrorCode.LOAD_FAILED, message="m")))
    assert err.code is ErrorCode.LOAD_FAILED and str(err.code) == "load_failed"
    assert msgpack.unpackb(encode(err))["code"] == "load_failed"


def test_every_message_round_trips_with_version():
    samples = [
        Generate(rid="a", messages=[{"role": "user", "content": "hi"}],
                 sampling=SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=40,
                                         min_p=0.1, seed=3, repetition_penalty=1.1,
                                         presence_penalty=0.5, frequency_penalty=-0.5,
                                         logit_bias=((1, 2.0), (5, -100.0))),
                 output=OutputSpec(stop=("x",), logprobs=True, top_logprobs=2,
                                   response_format="json_schema", json_schema={"type": "object"},
                                   tools=[{"type": "function", "function": {"name": "f"}}],
                                   tool_choice="required", allowed_tools=("f",),
                                   parallel_tool_calls=False, reasoning_effort="low"),
                 template_kwargs={"k": True}, log_prompt=True),
        Generate(rid="b", prompt_ids=pack_ids([1, 2, 3]),
                 cache=PromptCache(namespace="k", keep_as="resp_2", resume_from="resp_1",
                                   resume_label="resp_1")),
        Cancel(rid="a"), StatusRequest(qid=7), Shutdown(),
        CacheCommand(qid=3, op="drop", name="resp_1"),
        CacheReply(epoch=1, qid=3, entries=[SnapshotInfo(name="resp_1", tokens=9, ram_bytes=4,
                                                         disk_bytes=5, used_at=1.5)]),
        Ready(epoch=1, model="m", context_length=4096, pid=9, slots=1, random_weights=True),
        Started(epoch=1, rid="a", prompt_tokens=10, cached_tokens=2),
        Delta(epoch=1, rid="a", text="x", token_ids=pack_ids([5])),
        Generate(rid="c", task=Task.EMBED, inputs=["a", "b"], dimensions=8),
        Generate(rid="d", task=Task.EMBED, input_ids=[pack_ids([1, 2]), pack_ids([3])]),
        Generate(rid="e", task=Task.SCORE, prompt="q", inputs=["d1"]),
        Tokens(epoch=1, rid="a", ids=pack_ids([1, 2]), pieces=[b"a", b"\xe2"], text="ab"),
        Pooled(epoch=1, rid="a", rows=2, dim=2, data=pack_floats([0.5, 1, -1, 2]),
               tokens=[3, 4]),
        Ready(epoch=1, model="e", context_length=512, pid=9, model_kind=ModelKind.EMBED,
              dimensions=384),
        Done(epoch=1, rid="a", finish_reason=FinishReason.STOP),
        Error(epoch=1, code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, message="too long", rid="a",
              param="messages"),
        Status(epoch=1, qid=7, state="busy", active=["a"], waiting=["b"], steps=3),
        Heartbeat(epoch=1, state="ready", steps=4, progress=0.25),
        Generate(rid="f", task=Task.TRANSCRIBE, audio=b"RIFF", prompt="vocabulary",
                 speech=SpeechSpec(language="fr", translate=True, segments=True, words=True)),
        Generate(rid="g", task=Task.SPEAK, prompt="Hello.", speech=SpeechSpec(voice="ash",
                                                                              speed=1.5)),
        Transcript(epoch=1, rid="f", text="bonjour", language="french", duration=2.5,
                   segments=[Segment(0.0, 2.5, "bonjour", 0.2, -0.3, 1.1, 0.01, 0, [1, 2])],
                   words=[Word("bonjour", 0.1, 0.9)]),
        Audio(epoch=1, rid="g", sample_rate=24000, data=pack_floats([0.5, -0.25])),
        Ready(epoch=1, model="t", context_length=0, pid=9, model_kind=ModelKind.TTS,
              voices=["ash", "birch"], sample_rate=24000),
        Heartbeat(epoch=1, state="ready", prompt_cache=CacheStats(
            hits=1, snapshots=SnapshotStats(hits_disk=2, disk_read_seconds=0.5))),
    ]
    assert {type(m) for m in samples} == set(DOWN) | set(UP)
    for m in samples:
        raw = encode(m)
        wire = msgpack.unpackb(raw)
        assert wire["v"] == PROTOCOL_VERSION and wire["type"] == m.kind
        assert (decode_up if type(m) in UP else decode_down)(raw) == m


def test_directions_are_separate():
    # "status" is a type in both directions; each side only decodes its own.
    with pytest.raises(ProtocolError):
        decode_up(encode(Cancel(rid="a")))
    with pytest.raises(ProtocolError):
        decode_down(encode(Heartbeat(epoch=1, state="ready")))
    with pytest.raises(ProtocolError, match="not a protocol message"):
        encode(ToolCall(0, "id", "name", "{}"))


def _frame(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"garbage", b"\x93\x01\x02\x03",             # not msgpack / not a map
    msgpack.packb({"v": 1, "type": "cancel", "rid": "a"}),     # an older version
    msgpack.packb({"v": 99, "type": "cancel", "rid": "a"}),    # a newer one
    msgpack.packb({"v": "2", "type": "cancel", "rid": "a"}),   # a version that is no int
    msgpack.packb({"v": 2, "rid": "a"}),                       # no type
    _frame(type="explode"),                                    # unknown type
    _frame(type="cancel"),                                     # missing field
    _frame(type="cancel", rid=5),                              # wrong type
    _frame(type="generate", rid=None),                         # null where not nullable
    _frame(type="generate", rid="a", sampling={"max_tokens": "5"}),
    _frame(type="generate", rid="a", sampling={"max_tokens": True}),    # bool is no int
    _frame(type="generate", rid="a", sampling=[1, 2]),                  # a struct is a map
    _frame(type="generate", rid="a", sampling={"logit_bias": [[1, 2, 3]]}),  # not a pair
    _frame(type="generate", rid="a", output={"tool_choice": "sometimes"}),   # a literal
    _frame(type="generate", rid="a", messages=[{1: "x"}]),      # message keys are strings
    msgpack.packb({1: 2}),                                     # non-string keys
    # A Generate whose template_kwargs nest past the recursion limit.
    b"\x84\xa4type\xa8generate\xa1v\x02\xa3rid\xa1a\xaftemplate_kwargs\x81\xa1k"
    + b"\x91" * 100_000 + b"\x90",
])
def test_malformed_frames_are_typed_errors(frame):
    with pytest.raises(ProtocolError):
        decode_down(frame)


@pytest.mark.parametrize("frame", [
    _frame(type="done", epoch=1, rid="a", finish_reason="exploded"),  # no FinishReason
    _frame(type="error", epoch=1, code="oops", message="m"),          # no ErrorCode
    _frame(type="delta", epoch=1, rid="a", text="", tool_calls=[[0, "id", "name"]]),
])
def test_values_outside_the_enums_and_shapes_are_typed_errors(frame):
    with pytest.raises(ProtocolError):
        decode_up(frame)


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    raw = _frame(type="generate", rid="a", future_field=[1, 2],
                 sampling={"max_tokens": 3, "future_option": 1.0})
    g = decode_down(raw)
    assert g == Generate(rid="a", sampling=SamplingParams(max_tokens=3))
    assert g.output == OutputSpec() and g.output.stop == () and g.sampling.top_k is None


@pytest.mark.parametrize("cls", DOWN + UP + (SamplingParams, OutputSpec, ToolCall))
def test_new_fields_have_defaults_at_the_end(cls):
    # The compatibility rule: after the required fields, every field has a default (the
    # version header `v`, always written, aside).
    seen_default = False
    for f in msgspec.structs.fields(cls):
        if f.name == "v":
            continue
        assert not f.required or not seen_default, f"{cls.__name__}.{f.name}"
        seen_default |= not f.required
    if cls in (SamplingParams, OutputSpec):
        assert not any(f.required for f in msgspec.structs.fields(cls))


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


def _deep(n: int) -> list:
    value: list = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("kwargs,field,path", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "generate.messages"),
    ({"output": OutputSpec(stop=("ok", "\udfff"))}, "stop", "generate.output.stop"),
    ({"sampling": SamplingParams(max_tokens=2 ** 64)}, "max_tokens",
     "generate.sampling.max_tokens"),
    ({"sampling": SamplingParams(seed=-(2 ** 63) - 1)}, "seed", "generate.sampling.seed"),
    ({"sampling": SamplingParams(logit_bias=((2 ** 70, 1.0),))}, "logit_bias",
     "generate.sampling.logit_bias"),
    ({"output": OutputSpec(json_schema={"default": 2 ** 64})}, "json_schema",
     "generate.output.json_schema"),
    ({"template_kwargs": {"k": object()}}, "template_kwargs", "generate.template_kwargs"),
    ({"template_kwargs": {"k": _deep(100_000)}}, "template_kwargs", "generate.template_kwargs"),
])
def test_values_that_cannot_travel_are_typed_errors_naming_the_field(kwargs, field, path):
    with pytest.raises(EncodeError) as e:
        encode(Generate(rid="a", **kwargs))
    assert e.value.field == field and f"{path} cannot be encoded" in str(e.value)
    assert isinstance(e.value, ProtocolError)  # one family of protocol errors


@pytest.mark.parametrize("frame,rid", [
    (_frame(type="generate", rid="g1", sampling={"max_tokens": "5"}), "g1"),
    (msgpack.packb({"v": 1, "type": "generate", "rid": "old", "max_tokens": 5}), "old"),
    (_frame(type="generate", rid=7), None),                 # no readable rid
    (_frame(type="generate"), None),
    (_frame(type="cancel", rid="c1", extra=[]), None),     # no Generate: nothing to answer
    (b"\x00\xffgarbage", None),
])
def test_the_rid_of_an_unreadable_generate_can_still_be_read(frame, rid):
    from protocol.codec import unreadable_generate_rid

    assert unreadable_generate_rid(frame) == rid
