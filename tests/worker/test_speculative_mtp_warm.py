"""--warm-prompt with the MTP head (worker/kvcache/warm.py, worker/speculative/
mtp_prefill.py `PromptReader`): the pinned entry carries the head's state beside the
target's, as an entry the batch keeps does (tests/worker/test_speculative_mtp_resume.py),
so a conversation that starts from the pinned prefix has a head that has read the whole
prompt: its head cache is a cold prefill's, its text at temperature 0 the one decoding
gives without drafts, and its own entries carry the head's state, so its next turn
resumes with one too. Without the head nothing changes: the pinned entry has none."""

from __future__ import annotations

import pytest

from tests.generates import generate
from tests.worker.batchrun import make_batch
from tests.worker.test_speculative_mtp import mtp  # noqa: F401  (a fixture)
from tests.worker.test_speculative_mtp_resume import as_cold, turn
from worker.kvcache.prefix import PrefixCache, cache_nbytes
from worker.kvcache.warm import pin_warm_prompt

SYSTEM = "You are a careful coding agent who reads before editing. " * 8


@pytest.fixture
def warm_file(tmp_path):
    path = tmp_path / "warm.txt"
    path.write_text(SYSTEM)
    return path


def chat_ids(engine, user: str) -> list[int]:
    """The prompt of a conversation under the warm prompt (it begins with the pinned
    tokens)."""
    return engine.prepare(generate(rid="c", messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=16, temperature=0.0)).ids


def pinned_entry(batch):
    prefix = batch.kvcache.prefix
    ((tokens, entry),) = [(k[1], e) for k, e in prefix._lru.items() if e.pinned]
    return list(tokens), entry


def started(path, state_dir, warm):
    """The text kind's batch as the worker starts it (worker/loading/kinds.py: built,
    warmed, the warm prompt pinned) for the checkpoint at `path`, drafting with its head;
    64-token prefill chunks, so the warm prompt takes several."""
    from protocol.messages import ModelKind
    from protocol.settings import worker_parser
    from worker.loading import models
    from worker.loading.kinds import KINDS

    args = worker_parser().parse_args(
        ["--model", "m", "--commands", "c", "--events", "e", "--epoch", "0",
         "--state-dir", str(state_dir), "--speculative", "mtp", "--prefill-step", "64",
         "--warm-prompt", str(warm)])
    return KINDS[ModelKind.TEXT].start(models.load(str(path), path.parent), args)


def test_the_pinned_prompt_carries_the_heads_state_and_its_turns_resume_whole(
        mtp, warm_file, tmp_path):  # noqa: F811
    engine, batch = started(mtp[2], tmp_path, warm_file)
    head = batch.speculation.head
    pinned = batch.kvcache.prefix.stats()["pinned_tokens"]
    tokens, entry = pinned_entry(batch)
    assert len(tokens) == pinned > 64  # (more than one chunk: the head reads across them)
    # The head's state: its cache one position shorter than the target's, then h[n-1];
    # its bytes counted with the entry's.
    assert entry.head is not None and len(entry.head) == len(head.layers) + 1
    assert all(c.offset == pinned - 1 for c in entry.head[:-1])
    assert entry.nbytes == cache_nbytes(entry.cache) + cache_nbytes(entry.head)
    assert batch.kvcache.prefix.nbytes == entry.nbytes

    prompt = chat_ids(engine, "What next?")
    assert prompt[:pinned] == tokens
    cached, out, read = turn(engine, batch, prompt)
    assert cached == pinned
    assert as_cold(engine, head, prompt, read, out)
    assert out == turn(engine, make_batch(engine), prompt)[1]

    # The turn's own entries (the checkpoint at its prompt, its final state) carry the
    # head's state: the next turn resumes from the final one with it.
    # (A hybrid model: a checkpoint at the prompt but its last token, then the final.)
    prefix = batch.kvcache.prefix
    own = sorted(((k[1], e) for k, e in prefix._lru.items() if not e.pinned),
                 key=lambda o: len(o[0]))
    assert len(own[0][0]) == len(prompt) - 1 and len(own[-1][0]) > len(prompt)
    assert all(e.head is not None for _, e in own)
    final = list(own[-1][0])
    follow = final + [30, 31, 32]
    cached, out, read = turn(engine, batch, follow)
    assert cached == len(final)
    assert as_cold(engine, head, follow, read, out)


def test_without_the_head_the_pinned_entry_has_none(mtp, warm_file):  # noqa: F811
    engine, _, _ = mtp
    batch = make_batch(engine, prefix=PrefixCache(1 << 30))
    pinned = pin_warm_prompt(batch, warm_file, 64)
    tokens, entry = pinned_entry(batch)
    assert len(tokens) == pinned and entry.head is None
    assert entry.nbytes == cache_nbytes(entry.cache)
