"""The prompt-prefix cache: KV states of earlier prompts, reused by the next prompt that
starts with the same tokens.

A coding agent sends its whole conversation every turn (20K tokens and more), each turn
the previous one plus a little; re-prefilling it costs seconds to minutes. The worker
stores the KV state it holds at the end of each prompt (a snapshot, taken where the KV
cache manager schedules one: worker/kvcache/manager.py) and at the end of each generation
(prompt + output), and a new prompt starts from the longest stored prefix of its tokens.

Two kinds of state, one rule each:
- Trimmable caches (attention KV, quantized KV, a rotating cache that has not wrapped):
  an entry that shares only part of the new prompt is copied and trimmed back to the
  shared tokens. So one entry per conversation suffices: storing a trimmable entry drops
  the entries that are its prefixes.
- Caches that cannot be trimmed (the recurrent state of GatedDeltaNet / Mamba layers in
  hybrid models, a rotating cache that wrapped): only an entry whose tokens are all a
  prefix of the new prompt can be used. The snapshot taken at the end of each prompt is
  that prefix for the next turn, which extends the previous prompt; so these entries are
  never dropped for being prefixes.

Entries live in mlx-lm's token trie (`PromptTrie`), namespaced: by the request's
`prompt_cache_key` when it gives one, else one shared namespace. A pinned entry (the
operator's --warm-prompt, prefilled at load: worker/kvcache/warm.py) lives in the shared
namespace for the worker's life, serves prompts of every namespace, and is never evicted,
expired, swept as a prefix or cleared. A worker serves one
model, so entries never cross models. Bounded by bytes (least recently used first out)
and by age (`ttl`, seconds since last use). An entry whose state does not hold the
tokens it claims (its offset disagrees) is dropped and counted as a miss: recomputing is
always right, reusing a wrong state never is.

An entry may carry the MTP head's state beside the model's (`head`: the drafter's own
cache, one position shorter, and the hidden state of the last position, as cache
objects: worker/speculative/mtp.py `MTPSpeculation.state_of`; the pinned warm prompt's:
warm.py), so that a resumed prompt's head reads the whole prompt too. Its bytes count
with the entry's; it travels only with the whole entry: trimmed, an entry gives none
(the hidden state at the cut is not kept).

Only the MLX thread touches this (it holds MLX arrays); the figures in `stats()` are
plain ints the status publisher copies.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from worker.kvcache.trie import Trie

log = logging.getLogger("worker.kvcache.prefix")

SHARED = ""  # the namespace of requests without a prompt_cache_key, and of pinned entries


@dataclass
class Entry:
    cache: list          # the model's per-layer cache objects, holding `len(tokens)` tokens
    nbytes: int
    trimmable: bool
    used_at: float
    pinned: bool = False
    head: Optional[list] = None  # the MTP head's state beside it (module doc), or None


@dataclass
class Hit:
    cache: list          # a private copy, ready to be extended by the batch
    tokens: int          # prompt tokens it covers
    head: Optional[list] = None  # a private copy of the MTP head's state, where the
                                 # entry had one and was not trimmed


def cache_tokens(cache: list) -> Optional[int]:
    """How many tokens a cache says it holds (None: a state without a position, such as
    a recurrent layer's; the attention layers beside it say)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


class PrefixCache:
    def __init__(self, max_bytes: int, ttl: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.ttl = ttl                      # seconds unused before an entry expires; 0: never
        self._clock = clock
        self._trie = Trie()  # mlx-lm's PromptTrie, searched in the prompt's time
        self._lru: OrderedDict[tuple, Entry] = OrderedDict()  # (ns, tokens) → entry, LRU first
        self._pinned: list[tuple] = []      # tokens of the pinned entries (shared namespace)
        self.nbytes = 0
        self.hits = self.misses = self.tokens_reused = 0
        self.evictions = self.expirations = 0

    def __len__(self) -> int:
        return len(self._lru)

    # ---- lookups ---------------------------------------------------------------------

    def fetch(self, namespace: str, tokens: list[int], least: int = 0) -> Optional[Hit]:
        """A copy of the state of the longest usable stored prefix of `tokens`, leaving
        at least the last token to be fed (its logits start the generation); one of
        fewer than `least` tokens is not taken (a miss)."""
        self.expire()
        want = tokens[:-1]
        best = self._find(namespace, want) if want and self._lru else None
        for pin in self._pinned:  # the warm prompt serves every namespace
            if (best is None or len(pin) > best[2]) and tuple(want[:len(pin)]) == pin:
                best = (SHARED, list(pin), len(pin))
        hit = self._use(*best) if best is not None and best[2] >= least else None
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        self.tokens_reused += hit.tokens
        return hit

    def _find(self, ns: str, want: list[int]) -> Optional[tuple[str, list[int], int]]:
        """The entry that serves most of `want`: (its namespace, its tokens, how many of
        them serve), not yet copied (`_use`)."""
        found = self._trie.search(ns, want)
        if found.exact is not None:
            return ns, found.exact, len(found.exact)
        shorter = len(found.shorter) if found.shorter is not None else 0
        if found.longer is not None and found.common_prefix > shorter:
            entry = self._lru.get((ns, tuple(found.longer)))
            if entry is not None and entry.trimmable:
                return ns, found.longer, found.common_prefix
        if shorter:
            return ns, found.shorter, shorter
        return None

    def branch(self, namespace: str, tokens: list[int]) -> int:
        """How many of `tokens`' first tokens (but the last) a stored entry of the
        namespace shares with them beyond what a usable entry holds: where this prompt
        parts from an earlier one whose state cannot be trimmed back to the shared part
        (0: nowhere past a usable entry). Not counted as a hit or a miss."""
        want = tokens[:-1]
        if not want or not self._lru:
            return 0
        found = self._trie.search(namespace, want)
        if found.exact is not None:
            return 0
        shorter = len(found.shorter) if found.shorter is not None else 0
        return found.common_prefix if found.common_prefix > shorter else 0

    def state_of(self, namespace: str, tokens: list[int]) -> Optional[Hit]:
        """A copy of the state holding exactly `tokens` (a named snapshot's: worker/kvcache/
        snapshots.py): their entry, or a longer trimmable entry that begins with them,
        trimmed. Not counted as a hit or a miss."""
        self.expire()
        key = self._covering(namespace, tokens)
        return self._use(namespace, list(key), len(tokens)) if key is not None else None

    def holds(self, namespace: str, tokens: list[int]) -> int:
        """The bytes of the entry that holds the state of exactly `tokens` (0: none)."""
        key = self._covering(namespace, tokens)
        return self._lru[(namespace, key)].nbytes if key is not None else 0

    def _covering(self, ns: str, tokens: list[int]) -> Optional[tuple]:
        if not tokens or not self._lru:
            return None
        found = self._trie.search(ns, list(tokens))
        if found.exact is not None:
            return tuple(found.exact)
        if found.longer is not None and found.common_prefix == len(tokens):
            key = tuple(found.longer)
            entry = self._lru.get((ns, key))
            if entry is not None and entry.trimmable:
                return key
        return None

    def drop(self, namespace: str, tokens: list[int]) -> bool:
        """Forget the entry for exactly `tokens` (mlxctl cache drop)."""
        key = (namespace, tuple(tokens))
        if key not in self._lru:
            return False
        self._remove(key)
        return True

    def _use(self, ns: str, key_tokens: list[int], n: int) -> Optional[Hit]:
        """A copy of the entry for `key_tokens`, trimmed to its first `n` tokens; None
        (and the entry dropped) if its state is not what it claims."""
        key = (ns, tuple(key_tokens))
        entry = self._lru[key]
        cache = copy.deepcopy(entry.cache)
        extra = len(key_tokens) - n
        if extra and trim_prompt_cache(cache, extra) != extra:
            cache = None
        held = cache_tokens(cache) if cache is not None else -1
        if cache is None or (held is not None and held != n):
            log.warning("dropped a prompt-cache entry whose state disagrees with its tokens "
                        "(%s tokens held, %d expected)", held, n)
            self._remove(key)
            return None
        entry.used_at = self._clock()
        self._lru.move_to_end(key)
        head = copy.deepcopy(entry.head) if entry.head is not None and not extra else None
        return Hit(cache, n, head)

    # ---- storing ---------------------------------------------------------------------

    def store(self, namespace: str, tokens: list[int], cache: list,
              head: Optional[list] = None) -> bool:
        """Keep `cache` (which holds exactly `tokens`) for later prompts, with the MTP
        head's state beside it (`head`, holding one token fewer). Returns False when it
        was not kept (inconsistent, or larger than the whole budget)."""
        if not tokens or not cache:
            return False
        held = cache_tokens(cache)
        if held is not None and held != len(tokens):
            log.warning("did not cache a state holding %d tokens for %d tokens", held,
                        len(tokens))
            return False
        if head is not None and cache_tokens(head) != len(tokens) - 1:
            log.warning("did not keep an MTP head's state holding %s tokens beside %d",
                        cache_tokens(head), len(tokens))
            head = None
        nbytes = cache_nbytes(cache) + (cache_nbytes(head) if head is not None else 0)
        if nbytes > self.max_bytes:
            return False
        key = (namespace, tuple(tokens))
        if key in self._lru:
            self._remove(key)
        trimmable = can_trim_prompt_cache(cache)
        self._trie.add(namespace, tokens, True)
        if trimmable:
            # This entry serves every prompt its prefixes served (trimmed): drop them.
            for n, _ in self._trie.pop_prefixes(namespace, tokens):
                old = self._lru.pop((namespace, tuple(tokens[:n])), None)
                if old is not None and old.pinned:  # (stays: the longer one may go)
                    self._lru[(namespace, tuple(tokens[:n]))] = old
                    self._trie.add(namespace, tokens[:n], True)
                elif old is not None:
                    self.nbytes -= old.nbytes
        self._lru[key] = Entry(cache, nbytes, trimmable, self._clock(), head=head)
        self.nbytes += nbytes
        self.trim_to(self.max_bytes)
        return True

    def pin(self, tokens: list[int], cache: list, head: Optional[list] = None) -> bool:
        """Keep `cache` (holding exactly `tokens`, the MTP head's state `head` beside it)
        for the worker's life, in the shared namespace, for prompts of every namespace
        that begin with `tokens`."""
        if not self.store(SHARED, tokens, cache, head):
            return False
        self._lru[(SHARED, tuple(tokens))].pinned = True
        self._pinned.append(tuple(tokens))
        return True

    # ---- bounds ----------------------------------------------------------------------

    def _unpinned(self):
        """Keys of the entries that may go, least recently used first, as they are read:
        the callers stop at the first that stays (the batch bounds the cache several
        times a step, and a list of every entry each time was 3 % of a served tiny
        model's MLX thread with a full cache)."""
        return (k for k, e in self._lru.items() if not e.pinned)

    def trim_to(self, max_bytes: int) -> None:
        """Drop least recently used entries until at most `max_bytes` are held (pinned
        ones stay)."""
        over, doomed = self.nbytes - max(0, max_bytes), []
        for key in self._unpinned():
            if over <= 0:
                break
            doomed.append(key)
            over -= self._lru[key].nbytes
        for key in doomed:
            self._remove(key)
            self.evictions += 1

    def expire(self) -> None:
        if self.ttl <= 0:
            return
        limit = self._clock() - self.ttl
        doomed = list(itertools.takewhile(lambda k: self._lru[k].used_at <= limit,
                                          self._unpinned()))
        for key in doomed:
            self._remove(key)
            self.expirations += 1

    def clear(self) -> None:
        for key in list(self._unpinned()):
            self._remove(key)

    def _remove(self, key: tuple) -> None:
        entry = self._lru.pop(key)
        self.nbytes -= entry.nbytes
        if entry.pinned:
            self._pinned.remove(key[1])
        try:
            self._trie.pop(key[0], list(key[1]))
        except KeyError:  # already gone with a prefix sweep
            pass

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "tokens_reused": self.tokens_reused,
                "bytes": self.nbytes, "entries": len(self._lru), "evictions": self.evictions,
                "expirations": self.expirations,
                "pinned_tokens": sum(len(p) for p in self._pinned)}
