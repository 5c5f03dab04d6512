"""The worker's one KV cache manager: the batch asks it where a prompt starts and gives it
the states worth keeping; which tier holds what is decided here.

One query, `start`: the best starting state for a prompt's tokens in its namespace, or
for the named snapshot it resumes from, answered as a `Start` (the state, the prompt
tokens it covers, the tier it came from). Its tiers:
- the RAM prefix cache (worker/kvcache/prefix.py): states of earlier prompts, found by
  the longest stored prefix of the new prompt's tokens;
- the named snapshots (worker/kvcache/snapshots.py): a name points at a state of the
  prefix cache (RAM) or at a file of the disk tier (worker/kvcache/disk.py), read on the
  preparation thread (`preload`) so that a file read never stalls the MLX thread.
A named snapshot whose tokens begin the prompt wins; the prefix cache answers when there
is none, or when only the shared part of a disk state serves (a rewritten history) and
the prefix cache covers at least as much.

The store side: `checkpoints` says at which prompt lengths the batch hands a state over
(`keep`) for a cache that cannot be trimmed (recurrent layers, a rotating window): only a
state taken exactly at a prefix can serve a later prompt, so long prompts leave one every
`every` tokens, one at the prompt but its last token, one where the prompt parts from an
earlier one of its namespace (`branch`) and one where a chat's system prompt and tools end
(found by the engine), each at least `branch_min` tokens past where it started: prompts
that share a long system prompt and tools but not their last message, or an edited last
message, start from there (without them, a hybrid or windowed model's first turn of
every new conversation was prefilled whole: the states kept held more than the shared
part). A trimmable final state, trimmed, serves the same prompts. `finish` keeps a
sequence's final state, under its name too when its request gave one. The prefix cache
gives way to the running sequences (`trim_to`). Every tier carries the MTP head's state
beside a state where the batch hands one over (`head`: worker/kvcache/prefix.py), and
gives it back with the whole state.

Everything here runs on the MLX thread except `preload` (the preparation thread).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from protocol.messages import CacheStats, PromptCache, SnapshotInfo
from worker.kvcache import files
from worker.kvcache.disk import DiskTier
from worker.kvcache.prefix import PrefixCache
from worker.kvcache.snapshots import SnapshotStore

# Non-trimmable caches (recurrent layers) can only be reused from a snapshot taken
# exactly at a prefix; long prompts get one every this many tokens, so a prompt that
# shares only the first part of a long earlier one still finds a recent snapshot.
SNAPSHOT_EVERY = 4096
# ...and where a prompt parts from an earlier one or its system prompt ends, when that is
# at least this many tokens past the prompt's cached start (a state's copy for less is not
# worth keeping).
BRANCH_MIN = 128


class Tier(str, enum.Enum):
    """Where a starting state came from."""
    PREFIX = "prefix"        # the RAM prefix cache, by the prompt's tokens
    SNAPSHOT = "snapshot"    # a named snapshot held in RAM
    DISK = "disk"            # a named snapshot read from the disk tier


@dataclass
class Start:
    cache: list              # a private copy, ready to be extended by the batch
    tokens: int              # prompt tokens it covers
    tier: Tier
    head: Optional[list] = None  # the MTP head's state beside it (prefix.py), or None


def trimmable(model, max_kv_size: Optional[int]) -> bool:
    """Whether `model`'s cache can be trimmed back to a shorter prefix (a rotating cache,
    `--max-kv-size`'s or a sliding window's layers, trims only until it wraps: treated as
    untrimmable, though a fresh one says it can)."""
    cache = make_prompt_cache(model)
    return max_kv_size is None and can_trim_prompt_cache(cache) and not any(
        isinstance(c, RotatingKVCache) for c in cache)


class KVCache:
    def __init__(self, prefix: PrefixCache, disk: Optional[DiskTier] = None, *,
                 trimmable: bool = True, every: int = SNAPSHOT_EVERY,
                 branch_min: int = BRANCH_MIN):
        self.prefix = prefix
        self.snapshots = SnapshotStore(prefix, disk)
        self.trimmable = trimmable
        self.every = every
        self.branch_min = branch_min

    # ---- the query -------------------------------------------------------------------

    def preload(self, spec: PromptCache) -> Optional[files.Snapshot]:
        """Preparation thread: the disk's state for the snapshot `spec` resumes from, when
        memory has none (handed to `start` with the request)."""
        return self.snapshots.preload(spec.resume_from) if spec.resume_from else None

    def start(self, spec: PromptCache, ids: list[int],
              preloaded: Optional[files.Snapshot] = None, least: int = 0) -> Optional[Start]:
        """The best state for `ids` to start from (None: from scratch), at least the last
        token left to feed, and none of fewer than `least` tokens."""
        namespace = spec.namespace or ""
        resumed = None
        if spec.resume_from:
            resumed = self.snapshots.resume(spec.resume_from, namespace, ids, preloaded,
                                            spec.resume_label)
            if resumed is not None and resumed.tokens < least:
                resumed = None
        if resumed is not None and not resumed.partial:
            return Start(resumed.cache, resumed.tokens,
                         Tier.DISK if resumed.tier == "disk" else Tier.SNAPSHOT, resumed.head)
        found = self.prefix.fetch(namespace, ids, least)
        if found is not None and (resumed is None or found.tokens >= resumed.tokens):
            return Start(found.cache, found.tokens, Tier.PREFIX, found.head)
        return Start(resumed.cache, resumed.tokens, Tier.DISK, resumed.head) \
            if resumed else None

    # ---- storing ---------------------------------------------------------------------

    def checkpoints(self, cached: int, prompt: int, marks=(),
                    began: Optional[int] = None, shared: bool = False) -> list[int]:
        """The prompt lengths (ascending) at which a sequence that starts with `cached` of
        its `prompt` tokens hands its state to `keep`; `marks`: more points worth a state
        (where it parts from an earlier prompt: `branch`; where its system prompt ends:
        worker/text/engine.py `keeps_system`), each kept when `branch_min` past where the
        prompt's own prefill `began` (default `cached`: an image prompt's text starts
        after the images it prefilled itself: worker/vision/batch.py). `shared`: requests
        with the same prompt wait for its state (a request's `n` choices:
        worker/loop/batch.py `Batch.waits`), so the prompt but its last token is kept
        even where a later state could be trimmed to it."""
        if self.trimmable:
            return [prompt - 1] if shared and prompt - 1 > cached else []
        points = {n for n in range(self.every, prompt - 1, self.every) if n > cached}
        began = cached if began is None else began
        points.update(n for n in marks
                      if n > cached and began + self.branch_min <= n < prompt - 1)
        if prompt - 1 > cached:
            points.add(prompt - 1)  # the prompt but its last token
        return sorted(points)

    def branch(self, spec: PromptCache, key: list[int]) -> int:
        """Where the prompt `key` (its tokens as the prefix cache knows them) parts from
        an earlier prompt of its namespace whose state cannot serve the shared part (0:
        it does not, or the cache can be trimmed: a trimmed state serves it)."""
        return 0 if self.trimmable else self.prefix.branch(spec.namespace or "", key)

    def keep(self, spec: PromptCache, tokens: list[int], cache: list,
             head: Optional[list] = None) -> bool:
        """A state holding exactly `tokens` (and the MTP head's beside it, `head`), for
        later prompts of its namespace."""
        return self.prefix.store(spec.namespace or "", tokens, cache, head)

    def finish(self, spec: PromptCache, tokens: list[int], cache: list,
               head: Optional[list] = None) -> None:
        """A sequence ended holding `tokens` in `cache` (the MTP head's state beside it:
        `head`): kept for later prompts, and under the name its request gave (in memory
        and on disk)."""
        kept = self.keep(spec, tokens, cache, head)
        if spec.keep_as:
            self.snapshots.keep(spec.keep_as, spec.namespace or "", tokens, cache, kept,
                                head)

    def pin(self, tokens: list[int], cache: list, head: Optional[list] = None) -> bool:
        """The operator's --warm-prompt (worker/kvcache/warm.py), with the MTP head's
        state beside it (`head`): kept for the worker's life, for prompts of every
        namespace."""
        return self.prefix.pin(tokens, cache, head)

    def trim_to(self, room: int) -> None:
        """The prefix cache within `room` bytes (and its own bound)."""
        self.prefix.trim_to(min(self.prefix.max_bytes, room))

    # ---- admin (mlxctl cache) and life -----------------------------------------------

    def entries(self) -> list[SnapshotInfo]:
        return self.snapshots.entries()

    def save(self, name: str) -> tuple[bool, str]:
        return self.snapshots.save(name)

    def drop(self, name: str) -> bool:
        return self.snapshots.drop(name)

    def clear(self) -> int:
        """Forget every snapshot and the whole prefix cache; returns the snapshots."""
        return self.snapshots.clear()

    def stats(self) -> CacheStats:
        return CacheStats(**self.prefix.stats(), snapshots=self.snapshots.stats())

    def close(self) -> None:
        """The disk writes queued reach the disk."""
        if self.snapshots.disk is not None:
            self.snapshots.disk.close()
