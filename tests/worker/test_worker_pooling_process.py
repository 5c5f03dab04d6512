"""An embedding worker process, driven over its real sockets: Ready says its kind, every
request gets exactly one Done (done, refused, cancelled mid-way, or drained at shutdown),
and a text worker answers TOKENIZE with exactly the ids a generation prefills."""

from __future__ import annotations

import pytest

from protocol import (Cancel, Generate, ModelKind, SamplingParams, Shutdown, Task,
                      unpack_floats)

pytestmark = pytest.mark.integration


def test_an_embedding_worker_serves_cancels_and_drains(spawn, embed_model):
    w = spawn(embed_model("bert"))
    ready, _ = w.wait_for("ready", timeout=60)
    assert ready.model_kind is ModelKind.EMBED and ready.dimensions == 64
    assert ready.context_length == 512

    w.send(Generate(rid="a", task=Task.EMBED, inputs=["one", "two words", "three"]))
    events = w.collect("a")
    assert [e.kind for e in events] == ["started", "pooled", "done"]
    pooled, done = events[1], events[2]
    assert (pooled.rows, pooled.dim) == (3, 64) and len(unpack_floats(pooled.data)) == 192
    assert done.finish_reason == "stop" and done.prompt_tokens == sum(pooled.tokens)

    # A long request is cancelled between its batches: no result, one Done.
    w.send(Generate(rid="long", task=Task.EMBED, inputs=["word " * 400] * 2048))
    w.send(Cancel(rid="long"))
    events = w.collect("long", timeout=60)
    assert [e.kind for e in events][-1] == "done" and events[-1].finish_reason == "cancelled"
    assert "pooled" not in [e.kind for e in events]

    # A chat request: refused with the reason, then its Done.
    w.send(Generate(rid="chat", messages=[{"role": "user", "content": "hi"}]))
    events = w.collect("chat")
    assert [e.kind for e in events] == ["error", "done"]
    assert "embedding model" in events[0].message

    # Shutdown with work queued: each request still gets exactly one Done.
    rids = [f"q{i}" for i in range(4)]
    for rid in rids:
        w.send(Generate(rid=rid, task=Task.EMBED, inputs=["word " * 400] * 256))
    w.send(Shutdown())
    dones = {}
    while len(dones) < len(rids):
        msg = w.recv(timeout=60)
        if msg.kind == "done":
            assert msg.rid not in dones
            dones[msg.rid] = msg.finish_reason
    assert set(dones) == set(rids)
    assert w.proc.wait(30) == 0


def test_tokenize_counts_what_generation_prefills(spawn, tiny_model):
    w = spawn(tiny_model)
    w.wait_for("ready", timeout=60)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is MLX?"}]
    w.send(Generate(rid="t", task=Task.TOKENIZE, messages=messages))
    started, tokens, done = w.collect("t")
    assert (started.kind, tokens.kind, done.kind) == ("started", "tokens", "done")
    assert len(tokens.id_list()) == started.prompt_tokens == done.prompt_tokens
    assert len(tokens.pieces) == started.prompt_tokens
    assert b"".join(tokens.pieces).decode() .count("What is MLX?") == 1

    w.send(Generate(rid="g", messages=messages, sampling=SamplingParams(max_tokens=2)))
    events = w.collect("g")
    assert events[0].kind == "started"
    assert events[0].prompt_tokens == started.prompt_tokens
    assert events[-1].prompt_tokens == done.prompt_tokens

    w.send(Generate(rid="d", task=Task.DETOKENIZE, prompt_ids=tokens.ids))
    _, back, _ = w.collect("d")
    assert "What is MLX?" in back.text
    w.send(Generate(rid="e", task=Task.EMBED, inputs=["x"]))
    assert [e.kind for e in w.collect("e")] == ["error", "done"]
