"""The prefix cache's trie search (worker/kvcache/trie.py): the same answers as mlx-lm's
`PromptTrie.search` (an entry that serves the same common prefix where mlx-lm names the
shortest), without walking the stored entries that merely share the prompt's opening, as
every chat prompt shares its template's. Milliseconds."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.models.cache import KVCache as LayerCache
from mlx_lm.models.cache import PromptTrie

from worker.kvcache.prefix import SHARED, PrefixCache
from worker.kvcache.trie import Trie


class Untouchable(dict):
    """A trie branch no search may enter: any read of it fails the test."""

    def _fail(self, *a, **k):
        raise AssertionError("the search walked a branch it did not need")

    __iter__ = __contains__ = __getitem__ = keys = items = values = get = _fail


def state(n: int) -> list:
    """A one-layer attention state of `n` tokens."""
    layer = LayerCache()
    kv = mx.zeros((1, 1, n, 1))
    layer.update_and_fetch(kv, kv)
    mx.eval(layer.state)
    return [layer]


def filled(trie, entries):
    for tokens in entries:
        trie.add("ns", list(tokens), tuple(tokens))
    return trie


def test_matches_mlx_lm_on_random_tries():
    rng = random.Random(0)
    for _ in range(300):
        entries = {tuple(rng.randrange(4) for _ in range(rng.randrange(1, 9)))
                   for _ in range(rng.randrange(1, 8))}
        ours, theirs = filled(Trie(), entries), filled(PromptTrie(), entries)
        for _ in range(10):
            prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
            got, want = ours.search("ns", prompt), theirs.search("ns", prompt)
            assert (got.exact, got.shorter, got.common_prefix) == \
                (want.exact, want.shorter, want.common_prefix)
            assert (got.longer is None) == (want.longer is None)
            if got.longer is not None:  # a stored entry through the same common prefix
                assert tuple(got.longer) in entries
                assert got.longer[:got.common_prefix] == prompt[:got.common_prefix]
                assert got.longer[got.common_prefix:got.common_prefix + 1] != \
                    prompt[got.common_prefix:got.common_prefix + 1]
    assert Trie().search("other", [1, 2]).common_prefix == 0


def test_a_shared_opening_does_not_walk_the_other_entries():
    """Two chat prompts share their template's first tokens, then differ: the prefix
    cache's lookup descends one stored entry, never the others below the shared opening
    (mlx-lm's own search walks them all)."""
    opening = [1, 50]
    first = opening + list(range(300, 340))
    cache = PrefixCache(1 << 30)
    assert cache.store(SHARED, first, state(len(first)))
    cache._trie._trie[SHARED][1][50][999] = Untouchable({5: {"__value__": "x"}})  # another
    hit = cache.fetch(SHARED, opening + list(range(600, 640)))
    assert hit is not None and hit.tokens == 2
