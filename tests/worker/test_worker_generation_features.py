"""Grammar-constrained decoding, tool calls, reasoning and logprobs in the real engine, on
tiny random-weight models: the grammar is what makes their output meaningful, so these
assert validity, structure, counts and determinism, never words."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from protocol.messages import INVALID_REQUEST, Generate
from tests.generates import generate
from worker.loading import models
from worker.text.engine import TextEngine
from worker.errors import RequestError
from tests.worker.batchrun import steps as run_steps

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["n"]},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["name", "tags", "ok"]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"]},
        "color": {"enum": ["red", "green", None]}},
     "required": ["point", "color"]},
]

_engines: dict = {}


@pytest.fixture
def family_engine(family_model):
    def get(family: str) -> TextEngine:
        if family not in _engines:
            path = family_model(family)
            loaded = models.load(str(path), path.parent)
            _engines[family] = loaded
        loaded = _engines[family]
        return TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                          loaded.vocab_size)
    return get


def chat(**kw) -> Generate:
    kw.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("template_kwargs", {"enable_thinking": False})
    return generate(rid="t", **kw)


def run(engine, g):
    """(answer, reasoning, calls, finish, tokens, extras) of one request."""
    steps = [s for s in run_steps(engine, engine.prepare(g)) if s is not None]
    extras = [s[3] for s in steps if s[3] is not None]
    return ("".join(s[1] for s in steps), "".join(e.reasoning for e in extras),
            [c for e in extras for c in e.tool_calls], steps[-1][2],
            [s[0] for s in steps if s[0] >= 0], extras)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["integer", "array-enum-bool", "nested"])
@pytest.mark.parametrize("family", ["chatml", "qwen"])
def test_json_schema_output_validates(family_engine, family, schema):
    engine = family_engine(family)
    for seed in (None, 1, 2):
        g = chat(response_format="json_schema", json_schema=schema, seed=seed,
                 temperature=0.0 if seed is None else 1.0)
        text, reasoning, calls, finish, tokens, _ = run(engine, g)
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop" and calls == [] and reasoning == ""
        assert len(tokens) < 200  # ended because the grammar completed, not max_tokens


def test_json_object_is_an_object_and_whitespace_is_bounded(family_engine):
    engine = family_engine("chatml")
    text, *_ = run(engine, chat(response_format="json_object"))
    assert isinstance(json.loads(text), dict)
    assert "  " not in text and "\n" not in text  # no free runs of blanks


def test_constrained_greedy_is_deterministic(family_engine):
    engine = family_engine("qwen")
    g = chat(response_format="json_schema", json_schema=SCHEMAS[1])
    assert run(engine, g)[4] == run(engine, g)[4]


@pytest.mark.parametrize("family", ["qwen", "qwen3_coder", "llama3", "mistral", "pythonic",
                                    "gemma"])
def test_required_tool_choice_makes_valid_calls_in_each_family_format(family_engine, family):
    engine = family_engine(family)
    for seed in (None, 3):
        g = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
                 temperature=0.0 if seed is None else 1.0)
        text, _, calls, finish, tokens, _ = run(engine, g)
        assert finish == "tool_calls" and len(calls) == 1, (family, text, calls)
        assert text == ""  # the call's markup never reaches the answer
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS[calls[0].name])


def test_named_tool_choice_calls_that_tool(family_engine):
    engine = family_engine("qwen")
    for name in ("get_weather", "get_time"):
        _, _, calls, finish, _, _ = run(engine, chat(
            tools=TOOLS, tool_choice="required", allowed_tools=[name], parallel_tool_calls=False))
        assert finish == "tool_calls" and [c.name for c in calls] == [name]
        jsonschema.validate(json.loads(calls[0].arguments), PARAMS[name])


def test_parallel_calls_each_validate(family_engine):
    engine = family_engine("qwen")
    _, _, calls, _, _, _ = run(engine, chat(tools=TOOLS, tool_choice="required",
                                            allowed_tools=["get_time"], max_tokens=120))
    assert len(calls) >= 2  # the random model keeps calling; every complete call parses
    assert [c.index for c in calls] == list(range(len(calls)))
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])


def test_tool_choice_none_and_auto(family_engine):
    engine = family_engine("qwen")
    start = engine.tokenizer.encode("<tool_call>", add_special_tokens=False)
    # "none": the call marker is banned, so no call can even begin.
    prep = engine.prepare(chat(tools=TOOLS, tool_choice="none"))
    assert prep.banned == tuple(start) and prep.constraint is None
    text, _, calls, finish, tokens, _ = run(engine, chat(tools=TOOLS, tool_choice="none",
                                                         logit_bias=[[start[0], 50.0]]))
    assert calls == [] and start[0] not in tokens and finish == "length"
    # "auto": free text, and a call once the model opens one (tests/worker/test_worker_tool_json.py);
    # biasing the marker up makes the model open a call.
    prep = engine.prepare(chat(tools=TOOLS, tool_choice="auto"))
    assert prep.constraint is not None and prep.splitter is not None
    text, _, _, _, tokens, _ = run(engine, chat(tools=TOOLS, max_tokens=20,
                                                logit_bias=[[start[0], 50.0]]))
    assert start[0] in tokens and "<tool_call>" not in text


def test_tools_are_rendered_by_the_template_with_history(family_engine):
    engine = family_engine("qwen")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = engine.prepare(chat(messages=messages, tools=TOOLS)).ids
    text = engine.tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tool list
    # the past call rendered back in the family's own format, arguments as an object
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' \
        in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_reasoning_is_split_and_counted(family_engine):
    engine = family_engine("qwen")  # its template opens <think>: the output starts there
    g = chat(max_tokens=12, template_kwargs=None)
    text, reasoning, _, finish, tokens, extras = run(engine, g)
    assert reasoning and len(tokens) == 12 and finish == "length"
    assert "<think>" not in text + reasoning and "</think>" not in text + reasoning
    assert extras[0].in_reasoning  # counted as reasoning tokens (Done.reasoning_tokens)
    # thinking off (enable_thinking false, or reasoning_effort "none"): no reasoning
    for g in (chat(max_tokens=12), chat(max_tokens=12, template_kwargs=None,
                                        reasoning_effort="none")):
        text, reasoning, *_ = run(engine, g)
        assert reasoning == "" and text


def test_logprob_invariants(family_engine):
    engine = family_engine("chatml")
    for g in (chat(max_tokens=15, logprobs=True, top_logprobs=5),
              chat(max_tokens=15, logprobs=True, top_logprobs=5, temperature=1.0, seed=7),
              chat(logprobs=True, top_logprobs=3, response_format="json_schema",
                   json_schema=SCHEMAS[0])):
        _, _, _, _, tokens, extras = run(engine, g)
        extras = [e for e in extras if e.logprob is not None]
        assert len(extras) == len(tokens)
        for tok, e in zip(tokens, extras):
            assert e.logprob <= 0 and len(e.top) == g.output.top_logprobs
            lps = [lp for _, lp in e.top]
            assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
            assert len(e.token_bytes) == 1 + len(e.top)
            for t, lp in e.top:
                if t == tok:
                    assert math.isclose(lp, e.logprob, abs_tol=1e-5)
            if g.sampling.temperature == 0.0:
                assert e.top[0][0] == tok  # greedy picks the argmax
    # constrained: a masked-out alternative reports -9999, never -inf
    assert any(lp == -9999.0 for e in extras for _, lp in e.top)


def test_sampling_extras_change_greedy_output(family_engine):
    engine = family_engine("chatml")
    plain = run(engine, chat(max_tokens=30))[4]
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
               {"logit_bias": [[plain[0], -100.0]]}):
        other = run(engine, chat(max_tokens=30, **kw))[4]
        assert len(other) == 30 and other != plain, kw
    assert run(engine, chat(max_tokens=30, logit_bias=[[plain[0], -100.0]]))[4][0] != plain[0]


def test_bad_constraints_are_request_errors(family_engine):
    engine = family_engine("chatml")
    bad = [
        chat(response_format="json_schema", json_schema={"type": "bogus"}),
        chat(tools=TOOLS, tool_choice="required"),  # chatml has no tool-call format
        chat(logit_bias=[[10 ** 6, 1.0]]),
    ]
    for g in bad:
        with pytest.raises(RequestError) as e:
            engine.prepare(g)
        assert e.value.code == INVALID_REQUEST and e.value.param, g


def test_gemma_refuses_to_force_calls_its_format_cannot_carry(family_engine):
    # FunctionGemma arguments are strings or JSON scalars: an array argument cannot be
    # written so that mlx-lm's parser reads it back, so forcing such a call is a 400.
    engine = family_engine("gemma")
    tags = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"]}}}
    with pytest.raises(RequestError) as e:
        engine.prepare(chat(tools=[tags], tool_choice="required"))
    assert e.value.code == INVALID_REQUEST and e.value.param == "tools"
    assert "tags" in e.value.message and "auto" in e.value.message
    # "auto" serves it, unconstrained (its calls are parsed as they come).
    assert engine.prepare(chat(tools=[tags], tool_choice="auto")).constraint is None
