"""Hostile schemas are request errors, compiled grammars are reused (issue #9, finding 3).

In-process on the tiny model: the engine's preparation and generation, and the grammar
compiler's counters (cache hits are counted, not timed); and one real worker process.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from protocol import encode
from protocol.messages import INVALID_REQUEST, Cancel, Generate
from tests.generates import generate
from tests.worker.test_worker_scheduler import serve
from worker.errors import RequestError
from tests.worker.batchrun import steps as run_steps

RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
HUGE_PATTERN = {"type": "string", "pattern": "^(a{1000}){1000}$"}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def wide_any_of(n: int) -> dict:
    """`anyOf` of n small object branches (finding 3 used 5000: ~0.6 MB)."""
    return {"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "string"},
                                                        f"q{i}": {"type": "integer"}},
                       "required": [f"p{i}", f"q{i}"]} for i in range(n)]}


def chat(schema, rid: str = "g", **kw) -> Generate:
    return generate(rid=rid, messages=[{"role": "user", "content": "Give me JSON"}],
                    max_tokens=kw.pop("max_tokens", 40), temperature=0.0,
                    response_format="json_schema", json_schema=schema, **kw)


def generate_all(engine, g: Generate) -> list:
    return [out for out in run_steps(engine, engine.prepare(g)) if out is not None]


def test_a_repeated_schema_is_compiled_once(engine):
    compiler = engine.grammars.compiler
    first = engine.prepare(chat(SMALL)).constraint
    second = engine.prepare(chat(SMALL)).constraint
    assert (compiler.builds, compiler.hits) == (1, 1)
    engine.prepare(chat({**SMALL, "required": []}))  # another schema: another build
    assert (compiler.builds, compiler.hits) == (2, 1)
    # Each request has its own matcher: advancing one leaves the other at the start.
    start = first.allowed()
    first.consume(int(np.flatnonzero(start)[0]))
    assert not np.array_equal(first.allowed(), start)
    assert np.array_equal(second.allowed(), start)


def test_a_cached_schema_still_generates_valid_output(engine):
    outs = [generate_all(engine, chat(SMALL, max_tokens=60)) for _ in range(2)]
    assert engine.grammars.compiler.hits == 1
    texts = ["".join(o[1] for o in out) for out in outs]
    assert texts[0] == texts[1] and isinstance(json.loads(texts[0])["ok"], bool)


def test_an_empty_language_is_a_400_before_any_token_and_the_refusal_is_cached(engine):
    for _ in range(2):
        with pytest.raises(RequestError) as e:
            engine.prepare(chat({"$ref": "#"}))
        assert (e.value.code, e.value.param) == (INVALID_REQUEST, "response_format")
        assert "admits no output" in e.value.message
    assert (engine.grammars.compiler.builds, engine.grammars.compiler.hits) == (1, 1)


@pytest.mark.parametrize("schema", [RECURSIVE_REQUIRED, HUGE_PATTERN, wide_any_of(5000)],
                         ids=["recursive-required", "pattern", "anyOf-5000"])
def test_a_grammar_that_fails_mid_decode_is_a_request_error(engine, schema):
    with pytest.raises(RequestError) as e:
        generate_all(engine, chat(schema))
    assert (e.value.code, e.value.param) == (INVALID_REQUEST, "response_format")
    assert "could not follow" in e.value.message and len(e.value.message) < 500


def test_mid_decode_grammar_failure_ends_the_request_not_the_worker(engine):
    link, _ = serve(engine, [chat(RECURSIVE_REQUIRED, rid="bad"), chat(SMALL, rid="ok")])
    err, done = [m for m in link.of("bad") if m.kind in ("error", "done")]
    assert (err.code, err.param, done.finish_reason) == (INVALID_REQUEST, "response_format",
                                                         "error")
    assert link.of("ok")[-1].finish_reason in ("stop", "length")


def test_a_compile_over_the_time_budget_is_a_400_and_finishes_in_the_background(engine):
    compiler = engine.grammars.compiler
    compiler.timeout = 0.0  # every build takes longer than this
    schema = wide_any_of(300)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as e:
        engine.prepare(chat(schema))
    assert time.monotonic() - t0 < 1.0
    assert e.value.param == "response_format" and "too complex" in e.value.message
    # The abandoned build completes and caches its grammar: the retry costs nothing.
    for _ in range(200):
        if compiler.builds == 1 and not compiler._running:
            break
        time.sleep(0.05)
    assert engine.prepare(chat(schema)).constraint is not None
    assert (compiler.builds, compiler.hits) == (1, 1)


def test_a_big_schema_compiles_while_another_request_decodes(spawn, tiny_model):
    """The real worker, the test playing a supervisor that sends ahead: a stream runs
    while the 5000-branch schema (finding 3) compiles and an empty-language schema behind
    it is refused. The stream never stalls for the compile, and the refusal comes while
    it still runs: preparation is off the thread that decodes. (One sequence at a time,
    so "big" waits for the slot.)"""
    w = spawn(tiny_model, "--max-batch-size", "1")
    w.wait_for("ready", timeout=60)
    # Greedy "Hello" has no EOS for thousands of tokens; logprobs make each step slower,
    # so the stream outlasts the compile with a wide margin.
    w.send(generate(rid="a", prompt="Hello", max_tokens=4000, temperature=0.0,
                    logprobs=True, top_logprobs=20))
    w.wait_for("delta", rid="a")
    # (built and encoded before the clock starts: on a busy machine this process's own
    # work on the 0.6 MB schema took half a second, read as the stream's stall)
    ahead = [encode(chat(wide_any_of(5000), rid="big")), encode(chat({"$ref": "#"}, rid="empty"))]
    sent = time.monotonic()
    for msg in ahead:
        w.send(msg)
    a_times, empty = [], []
    # (The refusal no longer waits for the compile: two preparation threads. The window
    # runs a second at least, the big schema's compile under way on the other thread.)
    while not (empty and empty[-1].kind == "done" and time.monotonic() - sent > 1.0):
        msg = w.recv(timeout=30)
        rid = getattr(msg, "rid", None)
        assert not (rid == "a" and msg.kind == "done"), "the stream ended first"
        if rid == "a" and msg.kind == "delta":
            a_times.append(time.monotonic())
        elif rid == "empty":
            empty.append(msg)
        else:
            assert rid != "big", msg  # waits for the slot
    window = time.monotonic() - sent
    assert [m.kind for m in empty] == ["error", "done"]
    assert (empty[0].code, empty[0].param) == (INVALID_REQUEST, "response_format")
    times = [sent, *a_times, sent + window]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(a_times) > 20 and max(gaps) < window / 2, (max(gaps), window)

    w.send(Cancel(rid="a"))
    assert w.collect("a")[-1].finish_reason == "cancelled"
    big = w.collect("big", timeout=30)
    assert [m.kind for m in big][-2:] == ["error", "done"]
    assert (big[-2].code, big[-2].param) == (INVALID_REQUEST, "response_format")
    assert "delta" not in [m.kind for m in big]
    w.send(chat(SMALL, rid="after"))
    assert w.collect("after", timeout=10)[-1].finish_reason in ("stop", "length")
