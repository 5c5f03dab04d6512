"""A hybrid model (recurrent GatedDeltaNet layers between attention layers, as in
Qwen3-Next / Qwen3.5) in the batch and the prompt cache: its recurrent state cannot be
trimmed back to a shorter prefix, so reuse comes from snapshots."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import Seq, make_batch, run_all, steps
from worker.kvcache.prefix import PrefixCache

SYSTEM = [10 + (i * 7) % 900 for i in range(200)]


@pytest.fixture
def hybrid(hybrid_engine):
    return hybrid_engine


def ids_gen(ids, name="r", **kw):
    kw.setdefault("max_tokens", 10)
    kw.setdefault("temperature", 0.0)
    return generate(rid=name, prompt_ids=pack_ids(ids), **kw)


def tokens(outcomes):
    return [o[0] for o in outcomes if o is not None and o[0] >= 0]


def run_one(batch, engine, g):
    cached = batch.add(Seq(g.rid), engine.prepare(g))
    out = []
    while batch.members:
        out += [o for _, o in batch.step()]
    return cached, tokens(out)


def test_its_cache_cannot_be_trimmed(hybrid):
    assert not can_trim_prompt_cache(make_prompt_cache(hybrid.model))


def test_batched_greedy_equals_alone(hybrid):
    prompts = {n: SYSTEM[: 40 * n] + [n] for n in (1, 2, 3)}
    together = run_all(make_batch(hybrid), {n: hybrid.prepare(ids_gen(p, str(n)))
                                            for n, p in prompts.items()})
    for n, p in prompts.items():
        assert tokens(together[n]) == tokens(steps(hybrid, hybrid.prepare(ids_gen(p)))), n


def test_the_next_turn_resumes_from_a_snapshot(hybrid):
    """Turn two extends turn one (its prompt, the reply, a new message): it starts from
    the state stored at the end of turn one, not from scratch, and says the same."""
    cache = PrefixCache(1 << 30)
    batch = make_batch(hybrid, prefix=cache)
    turn1 = SYSTEM + [20, 21, 22]
    cold1, reply = run_one(batch, hybrid, ids_gen(turn1))
    assert cold1 == 0 and len(cache) == 2  # the prompt's snapshot and the final state
    turn2 = turn1 + reply + [30, 31, 32]
    cached, out = run_one(batch, hybrid, ids_gen(turn2))
    assert cached >= len(turn1) - 1
    assert out == run_one(make_batch(hybrid), hybrid, ids_gen(turn2))[1]
    # A prompt that shares only the system part finds nothing it can use: the states
    # hold more than the shared part, and recurrent state cannot be trimmed back...
    other = SYSTEM + [40, 41]
    assert run_one(batch, hybrid, ids_gen(other))[0] == 0
    # ...but it keeps its state where it parted from them, so the next prompt that
    # shares only the system part starts there, and says what it says cold.
    third = SYSTEM + [50, 51, 52]
    cached, out = run_one(batch, hybrid, ids_gen(third))
    assert cached == len(SYSTEM)
    assert out == run_one(make_batch(hybrid), hybrid, ids_gen(third))[1]


def test_a_chats_system_prompt_is_a_state_the_next_chat_starts_from(hybrid, monkeypatch):
    """Where the cache cannot be trimmed, the engine marks where a chat's system prompt
    ends (the system message rendered with different user messages after it, as far as
    the renderings agree: the engine's `turn_prefix`) and the batch keeps the
    state there: the second conversation with the same system prompt starts from it
    (without the mark only the third did, from where the second parted), and says what
    it says cold."""
    monkeypatch.setattr(hybrid, "keeps_system", True)
    system = "You are a careful assistant. " + "Follow every rule below. " * 40

    def chat(rid, question):
        return generate(rid=rid, messages=[{"role": "system", "content": system},
                                           {"role": "user", "content": question}],
                        max_tokens=6, temperature=0.0)

    prep = hybrid.prepare(chat("a", "Hi"))
    (end,) = prep.marks
    assert 128 < end < len(prep.ids) - 2
    # The mark is where the system prompt's tokens end in the prompt, found again
    # (the rendering's tokens cached) for the next request with the same system prompt.
    assert hybrid.prepare(chat("b", "Where is the library?")).marks == (end,)
    assert hybrid.prepare(generate(rid="c", messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2)).marks == ()  # (no system prompt)
    batch = make_batch(hybrid, prefix=PrefixCache(1 << 30))
    assert run_one(batch, hybrid, chat("a", "Hi"))[0] == 0
    cached, out = run_one(batch, hybrid, chat("b", "Where is the library?"))
    assert cached == end
    monkeypatch.setattr(hybrid, "keeps_system", False)
    assert out == run_one(make_batch(hybrid), hybrid, chat("b", "Where is the library?"))[1]


def test_a_warm_up_of_the_system_prompt_alone_keeps_the_state_its_turn_continues_from(
        hybrid, monkeypatch):
    """Codex opens a session with a warm-up of its instructions and tools alone (a
    request of the system message only); the turn that continues it adds a developer
    message, which joins the system message (supervisor/api/responses/items.py), and its
    user messages. Where the cache cannot be trimmed, the warm-up's prompt but its last
    token holds the assistant turn's opening, which the turn does not have: the state
    where the system message's content ends is kept for it, and the turn starts there,
    as does a turn with only user messages after the same system message."""
    monkeypatch.setattr(hybrid, "keeps_system", True)
    system = "You are a coding agent. " + "Read the files before you edit them. " * 40

    def chat(rid, *messages, tokens=6):
        return generate(rid=rid, messages=[{"role": "system", "content": system}, *messages],
                        max_tokens=tokens, temperature=0.0)

    warm = chat("w", tokens=1)
    (end,) = hybrid.prepare(warm).marks
    assert 128 < end < len(hybrid.prepare(warm).ids) - 1
    turn = generate(rid="t", messages=[
        {"role": "system", "content": system + "\n\nThe sandbox is read-only."},
        {"role": "user", "content": "Fix the bug."}], max_tokens=6, temperature=0.0)
    other = chat("o", {"role": "user", "content": "Write a test."})
    batch = make_batch(hybrid, prefix=PrefixCache(1 << 30))
    assert run_one(batch, hybrid, warm)[0] == 0
    for request in (turn, other):
        cached, out = run_one(batch, hybrid, request)
        assert cached == end
        monkeypatch.setattr(hybrid, "keeps_system", False)
        assert out == run_one(make_batch(hybrid), hybrid, request)[1]
        monkeypatch.setattr(hybrid, "keeps_system", True)


def test_a_request_cancelled_in_its_prefill_leaves_the_state_it_reached(hybrid):
    """A prompt cancelled part way through its prefill (Codex's warm-up, when Codex starts
    its turn without waiting for it) leaves the KV cache the state its chunks reached, so
    a later prompt that begins the same starts there and says what it says cold."""
    long = SYSTEM * 3  # 600 tokens: chunks of 64
    batch = make_batch(hybrid, prefix=PrefixCache(1 << 30), snapshot_every=4096)
    seq = Seq("w")
    batch.add(seq, hybrid.prepare(ids_gen(long, "w")))
    for _ in range(3):
        batch.step()
    batch.remove(seq)
    assert not batch.members
    later = ids_gen(long + [30, 31], "t")
    cached, out = run_one(batch, hybrid, later)
    assert 64 <= cached < len(long)
    assert out == run_one(make_batch(hybrid), hybrid, later)[1]
