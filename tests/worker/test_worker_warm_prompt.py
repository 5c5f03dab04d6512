"""--warm-prompt (worker/kvcache/warm.py): the system prompt (or chat request) a worker
prefills at load and pins, so the first request that begins with it already hits, in any
namespace, with the cold output; pinned state survives eviction, sweeps and clear."""

from __future__ import annotations

import json

import pytest

from protocol.messages import Generate, Started
from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch
from worker.errors import LoadError
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.warm import pin_warm_prompt, warm_request

SYSTEM = "You are a careful coding agent. " * 20
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}}}}]


def chat(user, cache_key=None, tools=None):
    return generate(rid=user[:8], messages=[{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": user}],
                    max_tokens=6, temperature=0.0, namespace=cache_key, tools=tools)


def run_one(batch, engine, g):
    cached = batch.add(Seq(g.rid), engine.prepare(g))
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return cached, [o[0] for o in out if o[0] >= 0]


@pytest.fixture
def warm_file(tmp_path):
    path = tmp_path / "warm.txt"
    path.write_text(SYSTEM)
    return path


@pytest.mark.parametrize("model", ["tiny", "hybrid"])
def test_the_first_request_starts_from_the_pinned_prompt(engine, hybrid_engine, warm_file,
                                                         model):
    engine = engine if model == "tiny" else hybrid_engine
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    pinned = pin_warm_prompt(batch, warm_file, 64)
    prompt = engine.prepare(chat("What next?")).ids
    # All of the system turn and the opening of the user's, and nothing of the question.
    assert 40 < pinned < len(prompt) - 2
    assert batch.kvcache.prefix.stats()["pinned_tokens"] == pinned
    for key in (None, "agent-7"):  # any namespace
        cached, out = run_one(batch, engine, chat("What next?", cache_key=key))
        assert cached >= pinned
    cold = run_one(make_batch(engine), engine, chat("What next?"))[1]
    assert out == cold


def test_a_chat_request_with_tools_is_pinned_as_its_renders_share_it(engine, tmp_path):
    path = tmp_path / "warm.json"
    path.write_text(json.dumps({"model": "x", "tools": TOOLS,
                                "messages": [{"role": "system", "content": SYSTEM}]}))
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    pinned = pin_warm_prompt(batch, path, 64)
    g = chat("Open main.py", tools=TOOLS)
    assert run_one(batch, engine, g)[0] == pinned
    ids = engine.prepare(g).ids
    assert ids[:pinned] == engine.turn_prefix(warm_request(path))


def test_pinned_state_outlives_eviction_sweeps_and_clear(engine, warm_file):
    cache = PrefixCache(1 << 30)
    batch = make_batch(engine, prefix=cache)
    pinned = pin_warm_prompt(batch, warm_file, 64)
    run_one(batch, engine, chat("one"))  # its final state extends the pinned prefix
    cache.trim_to(0)
    cache.clear()
    assert len(cache) == 1 and cache.stats()["pinned_tokens"] == pinned
    assert run_one(batch, engine, chat("two"))[0] >= pinned


@pytest.mark.parametrize("content, message", [
    ("", "is empty"), ("{not json", "not valid JSON"), ('{"messages": []}', "non-empty"),
    ('{"messages": [{"role": "system", "content": "x"}], "tools": 3}', "`tools` must be"),
])
def test_a_bad_file_is_a_load_error_naming_it(tmp_path, content, message):
    path = tmp_path / "warm"
    path.write_text(content)
    with pytest.raises(LoadError, match=message):
        warm_request(path)
    with pytest.raises(LoadError, match="cannot read"):
        warm_request(tmp_path / "missing")


def test_a_worker_process_pins_before_ready(spawn, tiny_model, warm_file):
    w = spawn(tiny_model, "--warm-prompt", warm_file)
    w.wait_for("ready", timeout=60)
    w.send(Generate(rid="first", messages=chat("Hi there").messages,
                    sampling=chat("x").sampling))
    started = w.wait_for("started", rid="first")[0]
    assert isinstance(started, Started) and started.cached_tokens > 40
    w.collect("first")
    assert "--warm-prompt: " in w.stderr_text()
    bad = spawn(tiny_model, "--warm-prompt", warm_file.parent / "nope.txt", name="w2")
    err = bad.wait_for("error", timeout=60)[0]
    assert "--warm-prompt" in err.message and "cannot read" in err.message
