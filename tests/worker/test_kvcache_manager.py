"""The KV cache manager's one query (worker/kvcache/manager.py `start`): which tier answers
a prompt, with how many tokens, when a named snapshot, the prefix cache and the disk tier
could each serve; and the schedule of intermediate states for caches that cannot be
trimmed. States are small mlx-lm KVCaches built by hand (no model, no batch), so each
case is milliseconds."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache as LayerCache

from protocol import PromptCache
from worker.kvcache.disk import DiskTier
from worker.kvcache.manager import KVCache, Tier
from worker.kvcache.prefix import PrefixCache

CONV = [10 + i for i in range(12)]         # a conversation's first 12 tokens
MORE = CONV + [50 + i for i in range(8)]   # ... and 8 more (20)


def state(tokens: list[int]) -> list:
    """A two-layer attention state holding `tokens` (its values encode the positions, so
    a trimmed copy is told apart from a longer one by its offset)."""
    layers = []
    for _ in range(2):
        layer = LayerCache()
        n = len(tokens)
        kv = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
        layer.update_and_fetch(kv, kv)
        layers.append(layer)
    mx.eval([c.state for c in layers])
    return layers


def manager(disk_dir=None, **kw) -> KVCache:
    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, 1 << 30)
        disk.start()
    return KVCache(PrefixCache(1 << 30), disk, **kw)


def offset(start) -> int:
    return start.cache[0].offset


def test_a_prefix_entry_answers_a_prompt_without_names():
    kv = manager()
    kv.keep(PromptCache(namespace="k"), CONV, state(CONV))
    got = kv.start(PromptCache(namespace="k"), CONV + [1, 2])
    assert (got.tier, got.tokens, offset(got)) == (Tier.PREFIX, 12, 12)
    # Another namespace does not see it.
    assert kv.start(PromptCache(namespace="other"), CONV + [1, 2]) is None
    assert kv.prefix.hits == 1 and kv.prefix.misses == 1


def test_a_named_snapshot_that_begins_the_prompt_wins_even_over_a_longer_prefix():
    """The state the client names is the one it continues from: the prefix cache is not
    consulted (nor counted) when it serves, though it holds more of the prompt."""
    kv = manager()
    named = PromptCache(namespace="k", keep_as="resp_1")
    kv.finish(named, CONV, state(CONV))
    kv.keep(PromptCache(namespace="k"), MORE, state(MORE))  # (sweeps CONV's entry: trimmable)
    prompt = MORE + [99]
    resumed = kv.start(PromptCache(namespace="k", resume_from="resp_1"), prompt)
    assert (resumed.tier, resumed.tokens, offset(resumed)) == (Tier.SNAPSHOT, 12, 12)
    assert kv.snapshots.hits_ram == 1 and kv.prefix.hits == 0 and kv.prefix.misses == 0
    plain = kv.start(PromptCache(namespace="k"), prompt)
    assert (plain.tier, plain.tokens, offset(plain)) == (Tier.PREFIX, 20, 20)


def test_a_snapshot_that_does_not_begin_the_prompt_falls_back_to_the_prefix_cache():
    kv = manager()
    kv.finish(PromptCache(namespace="k", keep_as="resp_1"), MORE, state(MORE))
    rewritten = CONV + [7] + MORE[13:] + [99]  # departs at position 12
    got = kv.start(PromptCache(namespace="k", resume_from="resp_1"), rewritten)
    assert (got.tier, got.tokens, offset(got)) == (Tier.PREFIX, 12, 12)  # trimmed back
    assert kv.snapshots.fallbacks == 1 and kv.snapshots.hits_ram == 0


def test_an_unknown_name_is_a_miss_and_the_prefix_cache_answers():
    kv = manager()
    kv.keep(PromptCache(), CONV, state(CONV))
    got = kv.start(PromptCache(resume_from="resp_gone"), CONV + [1])
    assert (got.tier, got.tokens) == (Tier.PREFIX, 12)
    assert kv.snapshots.misses == 1
    assert kv.start(PromptCache(resume_from="resp_gone"), [5, 6, 7]) is None


def test_no_start_shorter_than_least():
    """`least` (CUDA's bucket, worker/loop/batch.py `cached_start`): a state of fewer
    tokens, from the prefix cache or a named snapshot, is not taken (a miss); one of as
    many is."""
    kv = manager()
    kv.keep(PromptCache(namespace="k"), CONV, state(CONV))
    assert kv.start(PromptCache(namespace="k"), CONV + [1, 2], least=13) is None
    assert kv.prefix.hits == 0 and kv.prefix.misses == 1
    got = kv.start(PromptCache(namespace="k"), CONV + [1, 2], least=12)
    assert (got.tier, got.tokens) == (Tier.PREFIX, 12) and kv.prefix.hits == 1
    kv.finish(PromptCache(namespace="n", keep_as="resp_1"), CONV, state(CONV))
    named = PromptCache(namespace="n", resume_from="resp_1")
    assert kv.start(named, MORE, least=13) is None
    assert kv.start(named, MORE, least=12).tier is Tier.SNAPSHOT


def test_a_disk_snapshot_serves_a_fresh_worker_and_memory_has_it_then(tmp_path):
    first = manager(tmp_path / "m")
    first.finish(PromptCache(namespace="k", keep_as="key:k"), MORE, state(MORE))
    assert first.snapshots.disk.flush()
    kv = manager(tmp_path / "m")
    spec = PromptCache(namespace="k", resume_from="key:k")
    got = kv.start(spec, MORE + [1], kv.preload(spec))
    assert (got.tier, got.tokens, offset(got)) == (Tier.DISK, 20, 20)
    again = kv.start(spec, MORE + [1])
    assert (again.tier, again.tokens) == (Tier.SNAPSHOT, 20)
    assert kv.preload(PromptCache(namespace="k")) is None  # nothing named: no read


REWRITTEN = CONV + [7, 8, 9]  # MORE's history rewritten after its 12th token


@pytest.mark.parametrize("cached,tier,tokens", [(CONV[:8], Tier.DISK, 12),
                                                (CONV, Tier.PREFIX, 12),
                                                (REWRITTEN[:14], Tier.PREFIX, 14)])
def test_the_shared_part_of_a_disk_snapshot_against_the_prefix_cache(tmp_path, cached, tier,
                                                                     tokens):
    """A rewritten history on a fresh worker: the disk state's shared part (trimmed)
    serves unless the prefix cache covers at least as much (a tie goes to the prefix)."""
    first = manager(tmp_path / "m")
    first.finish(PromptCache(namespace="k", keep_as="resp_1"), MORE, state(MORE))
    assert first.snapshots.disk.flush()
    kv = manager(tmp_path / "m")
    kv.keep(PromptCache(namespace="k"), cached, state(cached))
    got = kv.start(PromptCache(namespace="k", resume_from="resp_1"), REWRITTEN)
    assert (got.tier, got.tokens, offset(got)) == (tier, tokens, tokens)
    assert kv.snapshots.fallbacks == 1


def test_intermediate_states_only_for_caches_that_cannot_be_trimmed():
    assert manager(trimmable=True, every=100).checkpoints(0, 350) == []
    kv = manager(trimmable=False, every=100)
    # Every 100 tokens past what the cache supplied, and the prompt but its last token.
    assert kv.checkpoints(0, 350) == [100, 200, 300, 349]
    assert kv.checkpoints(200, 350) == [300, 349]
    assert kv.checkpoints(348, 350) == [349] and kv.checkpoints(349, 350) == []
    assert kv.checkpoints(0, 100) == [99]


def test_a_state_where_a_prompt_parts_from_an_earlier_one():
    """A cache that cannot be trimmed keeps one more state: where the prompt parts from
    an earlier prompt of its namespace (the prefix cache's `branch`), when that is at
    least `branch_min` past its cached start and before its last token."""
    kv = manager(trimmable=False, every=1000, branch_min=50)
    assert kv.checkpoints(0, 350, [120]) == [120, 349]
    assert kv.checkpoints(100, 350, [120]) == [349]        # 20 past the start: not worth it
    assert kv.checkpoints(100, 350, [120], began=0) == [120, 349]  # (an image prompt's)
    assert kv.checkpoints(0, 350, [349, 0]) == [349]       # (the usual one already; none)
    assert kv.checkpoints(0, 350, [60, 200]) == [60, 200, 349]  # (a system prompt's end too)
    assert manager(trimmable=True, branch_min=50).checkpoints(0, 350, [120]) == []
    spec = PromptCache(namespace="k")
    system = list(range(1, 201))
    kv.keep(spec, system + [7, 8, 9], state(system + [7, 8, 9]))
    # The new prompt shares the system part with a state holding more: it parts there.
    assert kv.branch(spec, system + [5, 6]) == 200
    assert kv.branch(PromptCache(namespace="other"), system + [5, 6]) == 0  # its own space
    kv.keep(spec, system, state(system))
    assert kv.branch(spec, system + [5, 6]) == 0  # a usable state holds the shared part
    assert kv.branch(spec, system + [7, 8, 1]) == 202  # it shares more with the longer one
    assert manager(trimmable=True).branch(spec, system + [5, 6]) == 0


def test_stats_admin_and_trim():
    kv = manager()
    kv.finish(PromptCache(keep_as="resp_1"), CONV, state(CONV))
    stats = kv.stats()
    assert stats.entries == 1 and stats.snapshots.named == 1
    assert [e.name for e in kv.entries()] == ["resp_1"]
    kv.trim_to(0)
    assert len(kv.prefix) == 0 and kv.prefix.max_bytes == 1 << 30
    assert kv.drop("resp_1") and kv.entries() == []
