"""Request validation: good bodies → fields, bad bodies → 400 naming the right param."""

from __future__ import annotations

import pytest

from protocol import SamplingParams, decode_down, encode, unpack_ids
from supervisor.api.chat.request import ChatRequest, parse_chat_request
from supervisor.api.completions.request import CompletionRequest, parse_completion_request
from supervisor.config import Config
from supervisor.http.errors import APIError

class _Drop:
    """In a patch: remove the key from the base body (named in test ids, which must be
    the same in every process that collects them: pytest-xdist's workers)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "Once upon a time"}


def patched(base: dict, patch: dict) -> dict:
    body = {**base, **patch}
    return {k: v for k, v in body.items() if v is not DROP}


# ---- chat: good bodies ---------------------------------------------------------------

def test_chat_minimal_defaults():
    req = parse_chat_request(CHAT)
    assert isinstance(req, ChatRequest)
    assert req.model == "m"
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert (req.stream, req.include_usage, req.max_tokens, req.stop, req.n) == \
        (False, False, None, (), 1)
    assert req.temperature is None and req.top_p is None and req.seed is None


def test_chat_all_sampling_fields():
    req = parse_chat_request(patched(CHAT, {
        "temperature": 0, "top_p": 1, "top_k": 40, "min_p": 0.05, "seed": -7,
        "repetition_penalty": 1.1, "stop": ["\n\n", "END"], "n": 1, "max_tokens": 9,
        "presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"50256": -100},
        "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "parallel_tool_calls": True, "prompt_cache_key": "conv-1",
        "chat_template_kwargs": {"enable_thinking": False},
    }))
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed) == (0, 1, 40, 0.05, -7)
    assert req.repetition_penalty == 1.1 and req.max_tokens == 9
    assert req.stop == ("\n\n", "END")
    assert (req.presence_penalty, req.frequency_penalty) == (-2, 2)
    assert req.logit_bias == {50256: -100}
    assert (req.user, req.metadata, req.store, req.service_tier) == ("u", {"k": "v"}, False, "auto")
    assert req.parallel_tool_calls is True and req.prompt_cache_key == "conv-1"
    assert req.template_kwargs == {"enable_thinking": False}
    g = req.to_generate(Config())
    assert g.template_kwargs == {"enable_thinking": False}
    assert g.output.stop == ("\n\n", "END")
    # Every sampling value the body gave reaches the worker, each in its field.
    assert g.sampling == SamplingParams(
        max_tokens=9, temperature=0, top_p=1, top_k=40, min_p=0.05, seed=-7,
        repetition_penalty=1.1, presence_penalty=-2, frequency_penalty=2,
        logit_bias=((50256, -100),))


def test_chat_stop_string_and_nulls_mean_absent():
    assert parse_chat_request(patched(CHAT, {"stop": "x"})).stop == ("x",)
    nulls = {k: None for k in (
        "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop", "n",
        "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
        "logit_bias", "user", "metadata", "store", "service_tier", "stream",
        "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "functions",
        "function_call", "response_format", "parallel_tool_calls", "chat_template_kwargs")}
    assert parse_chat_request(patched(CHAT, nulls)) == parse_chat_request(CHAT)


def test_chat_messages_normalized():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = parse_chat_request(patched(CHAT, {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                          {"type": "text", "text": "Be kind."}]},
        {"role": "system", "content": "sys", "name": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "assistant"},
        {"role": "user", "content": ""},
    ]}))
    assert req.messages == (
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "system", "content": "sys", "name": "s"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "No."},
        {"role": "assistant", "content": None},
        {"role": "user", "content": ""},
    )


def test_chat_max_completion_tokens_preferred():
    assert parse_chat_request(patched(CHAT, {"max_tokens": 5})).max_tokens == 5
    assert parse_chat_request(patched(CHAT, {"max_completion_tokens": 7})).max_tokens == 7
    assert parse_chat_request(patched(CHAT, {"max_tokens": 5,
                                             "max_completion_tokens": 7})).max_tokens == 7


def test_chat_stream_options():
    req = parse_chat_request(patched(CHAT, {"stream": True,
                                            "stream_options": {"include_usage": True}}))
    assert req.stream and req.include_usage
    req = parse_chat_request(patched(CHAT, {"stream": True, "stream_options": {}}))
    assert req.stream and not req.include_usage


def test_chat_harmless_feature_values_accepted():
    req = parse_chat_request(patched(CHAT, {
        "tools": [], "tool_choice": "none", "function_call": "auto", "logprobs": False,
        "top_logprobs": 0, "response_format": {"type": "text"},
    }))
    assert req == parse_chat_request(CHAT)


def test_chat_unknown_fields_ignored():
    body = patched(CHAT, {"modalities": ["text"], "x_custom": {1: 2},
                          "verbosity": "low", "prediction": None})
    assert parse_chat_request(body) == parse_chat_request(CHAT)


def test_chat_generate_round_trip():
    req = parse_chat_request(patched(CHAT, {"max_tokens": 3, "seed": 1, "stop": "x",
                                            "logprobs": True, "top_logprobs": 2}))
    msg = req.to_generate(Config())
    assert msg.prompt is None and msg.prompt_ids is None
    assert msg.messages == [{"role": "user", "content": "hi"}]
    assert (msg.sampling.max_tokens, msg.sampling.seed, msg.output.stop) == (3, 1, ("x",))
    assert msg.output.logprobs and msg.output.top_logprobs == 2
    assert decode_down(encode(msg)) == msg


# ---- chat: bad bodies ----------------------------------------------------------------

CHAT_BAD = [
    ({"model": DROP}, "model"),
    ({"model": None}, "model"),
    ({"model": 5}, "model"),
    ({"model": ""}, "model"),
    ({"messages": DROP}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [5]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": 1}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,A"}}]}]},
     "messages[0].content[1].image_url.url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}]}]},
     "messages[0].content[0].input_audio.format"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": None, "tool_call_id": "c"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": "f"}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": ["f"]}]},
     "messages[0].tool_calls[0]"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_p": False}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 2 ** 63}, "seed"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"stop": 5}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop[0]"),
    ({"stop": ["a", ""]}, "stop[1]"),
    ({"n": 129}, "n"),  # (OpenAI's bound)
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"n": "1"}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": "f"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tool_choice": "bogus"}, "tool_choice"),
    ({"tool_choice": 5}, "tool_choice"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"user": 5}, "user"),
    ({"metadata": "x"}, "metadata"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"store": "yes"}, "store"),
    ({"service_tier": 5}, "service_tier"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
]


def _expect_400(parse, body, param):
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400, err
    assert err.param == param, err
    assert err.type == "invalid_request_error"
    envelope = err.to_envelope()["error"]
    assert set(envelope) == {"message", "type", "param", "code"}
    assert envelope["message"] and isinstance(envelope["message"], str)
    return err


@pytest.mark.parametrize("patch,param", CHAT_BAD, ids=[repr(p)[:60] for p, _ in CHAT_BAD])
def test_chat_bad(patch, param):
    _expect_400(parse_chat_request, patched(CHAT, patch), param)


def test_chat_error_wording():
    err = _expect_400(parse_chat_request, patched(CHAT, {"n": 129}), "n")
    assert err.code == "integer_above_max_value" and "128" in err.message
    assert parse_chat_request(patched(CHAT, {"n": 128})).n == 128
    err = _expect_400(parse_chat_request, patched(CHAT, {"max_tokens": True}), "max_tokens")
    assert err.code == "invalid_type" and "boolean" in err.message
    err = _expect_400(parse_chat_request, patched(CHAT, {"messages": DROP}), "messages")
    assert err.code == "missing_required_parameter"
    err = _expect_400(parse_chat_request, patched(CHAT, {"tool_choice": "required"}),
                      "tool_choice")
    assert "needs at least one tool" in err.message
    err = _expect_400(parse_chat_request, patched(CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        "messages[0].content[0].image_url.url")
    assert "only base64 data: URLs" in err.message
    err = _expect_400(parse_chat_request, patched(CHAT, {"temperature": 3}), "temperature")
    assert err.code == "decimal_above_max_value"


# ---- text completions ----------------------------------------------------------------

def test_completion_defaults():
    req = parse_completion_request(TEXT)
    assert isinstance(req, CompletionRequest)
    assert req.prompts == (("Once upon a time", None),) and req.n == 1
    # Not given: the server's --default-max-tokens, else OpenAI's 16 (applied when the
    # Generate is built: supervisor/api/fields/generate.py).
    assert req.max_tokens is None and req.default_max_tokens == 16
    assert parse_completion_request(patched(TEXT, {"max_tokens": None})).max_tokens is None
    assert parse_completion_request(patched(TEXT, {"max_tokens": 100})).max_tokens == 100


@pytest.mark.parametrize("prompt,text,ids", [
    ("", "", None),
    (["one"], "one", None),
    ([1, 2, 3], None, (1, 2, 3)),
    ([[4, 5]], None, (4, 5)),
    ([0, 2 ** 32 - 1], None, (0, 2 ** 32 - 1)),
])
def test_completion_prompt_forms(prompt, text, ids):
    req = parse_completion_request(patched(TEXT, {"prompt": prompt}))
    assert req.prompts == ((text, ids),)


def test_completion_generate():
    req = parse_completion_request(patched(TEXT, {"prompt": [7, 8, 9], "stop": ["x"],
                                                  "temperature": 0.5, "stream": True,
                                                  "stream_options": {"include_usage": True},
                                                  "logprobs": 2}))
    assert req.stream and req.include_usage
    msg = req.to_generate(Config())
    assert msg.messages is None and msg.prompt is None
    assert unpack_ids(msg.prompt_ids) == [7, 8, 9]
    assert msg.output.stop == ("x",) and msg.sampling.temperature == 0.5
    assert msg.sampling.max_tokens == 16  # the endpoint's default: the server has none
    assert msg.output.logprobs and msg.output.top_logprobs == 2
    assert decode_down(encode(msg)) == msg
    text = parse_completion_request(TEXT).to_generate(Config())
    assert text.prompt == "Once upon a time" and text.prompt_ids is None
    assert not text.output.logprobs


def test_completion_unknown_and_harmless_fields():
    body = patched(TEXT, {"echo": False, "suffix": "", "best_of": 1, "logprobs": None,
                          "whatever": [1]})
    assert parse_completion_request(body) == parse_completion_request(TEXT)


TEXT_BAD = [
    ({"prompt": DROP}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices in all
    ({"prompt": ["a", [1, "x"]]}, "prompt[1]"),
    ({"prompt": ["a", [1, -1]]}, "prompt[1][1]"),
    ({"prompt": [[]]}, "prompt[0]"),
    ({"prompt": [["a"]]}, "prompt[0]"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": [1, 2 ** 32]}, "prompt[1]"),
    ({"prompt": [[3, -1]]}, "prompt[0][1]"),
    ({"model": DROP}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 6}, "logprobs"),
    ({"echo": "no"}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"n": 129}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": 5}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": "1"}, "seed"),
]


@pytest.mark.parametrize("patch,param", TEXT_BAD, ids=[repr(p)[:60] for p, _ in TEXT_BAD])
def test_completion_bad(patch, param):
    _expect_400(parse_completion_request, patched(TEXT, patch), param)


def test_completion_batch_of_prompts():
    """A list of prompts, strings and token ids mixed: one Generate each, in order."""
    req = parse_completion_request(patched(TEXT, {"prompt": ["a", [1, 2], "b"], "n": 2}))
    assert req.prompts == (("a", None), (None, (1, 2)), ("b", None)) and req.n == 2
    built = req.to_generates(Config())
    assert [(g.prompt, g.prompt_ids and unpack_ids(g.prompt_ids)) for g in built] == [
        ("a", None), (None, [1, 2]), ("b", None)]
    err = _expect_400(parse_completion_request,
                      patched(TEXT, {"prompt": ["a"] * 65, "n": 2}), "prompt")
    assert "at most 128 choices" in err.message


def test_completion_max_tokens_0_only_with_echo():
    """The spec's "prompt only": 0 with echo; without it, nothing to answer."""
    req = parse_completion_request(patched(TEXT, {"max_tokens": 0, "echo": True}))
    assert req.max_tokens == 0 and req.echo
    assert req.to_generate(Config()).sampling.max_tokens == 0
    _expect_400(parse_completion_request, patched(TEXT, {"max_tokens": 0}), "max_tokens")
