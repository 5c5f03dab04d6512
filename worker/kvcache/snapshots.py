"""Named KV snapshots: the exact state a generation ended with, kept under the name its
request gave (`PromptCache.keep_as`: the supervisor names them, for a stored response or a
prompt_cache_key conversation; here a name is opaque) so that the next turn resumes from it
(`resume_from`) and prefills only what is new.

Prefix matching alone (worker/kvcache/prefix.py) finds a state by the tokens of the newly
rendered prompt; it loses when the prompt cache was emptied (a worker restart, a swap, a
keep-alive unload, mlxd restarted) and, for models whose cache cannot be trimmed, keeps
only states at exact prefixes. A name says which state the client continues from, so:

- the RAM tier is the prompt-prefix cache itself: the final state is stored there as for
  any request, and the name points at its tokens (no second copy in memory). For a
  trimmable cache, a later, longer entry of the same conversation still holds it;
- the disk tier (worker/kvcache/disk.py) gets every named state, written off the MLX
  thread; a name not in memory is read from disk on the preparation thread (`preload`)
  and its state put back into the prefix cache;
- a state is used only when its tokens begin the new prompt (at least the prompt's last
  token is left to feed). When they do not (the template rewrote history: thinking
  stripped from past turns, tool results reformatted, a date in the system prompt), the
  request falls back to prefix matching, counted in `fallbacks` with a debug line naming
  the first differing position. A disk state of a trimmable cache still serves the
  shared part then, trimmed.

The MTP head's state beside a named state (worker/kvcache/prefix.py `head`) goes with it
to the disk tier and back (files.py); a disk state trimmed to the shared part gives none.

Everything here runs on the MLX thread except `preload`, which reads only the disk
tier and the set of names (a plain dict lookup).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from protocol.messages import SnapshotInfo, SnapshotStats
from worker.kvcache.prefix import Hit, PrefixCache, cache_tokens
from worker.kvcache import files
from worker.kvcache.disk import DiskTier

log = logging.getLogger("worker.kvcache")

# Names kept in memory point at token lists; bounded by their total length (4 bytes each).
MAX_NAMED_TOKENS = 4 << 20


@dataclass
class Named:
    namespace: str          # the prefix cache's namespace of the state
    tokens: np.ndarray      # uint32: the tokens the state holds
    used_at: float          # unix time


@dataclass
class Resumed(Hit):
    tier: str = "ram"       # "ram" | "disk"
    partial: bool = False   # a fallback: only the shared part of a disk state


def _first_difference(held: np.ndarray, ids: np.ndarray) -> int:
    """The first position where `ids` departs from `held` (len(held) if it does not)."""
    n = min(len(held), len(ids))
    diff = np.flatnonzero(held[:n] != ids[:n])
    return int(diff[0]) if diff.size else n


class SnapshotStore:
    def __init__(self, prefix: PrefixCache, disk: Optional[DiskTier] = None, *,
                 max_named_tokens: int = MAX_NAMED_TOKENS,
                 clock: Callable[[], float] = time.time):
        self.prefix = prefix
        self.disk = disk
        self.max_named_tokens = max_named_tokens
        self._clock = clock
        self._names: OrderedDict[str, Named] = OrderedDict()  # LRU first
        self._named_tokens = 0
        self.hits_ram = self.hits_disk = self.misses = self.fallbacks = 0

    # ---- preparation thread ----------------------------------------------------------

    def preload(self, name: str) -> Optional[files.Snapshot]:
        """The disk tier's state for `name` when memory has no name for it."""
        if self.disk is None or name in self._names:
            return None
        return self.disk.load(name)

    # ---- resuming (MLX thread) -------------------------------------------------------

    def resume(self, name: str, namespace: str, ids: list[int],
               preloaded: Optional[files.Snapshot] = None,
               label: str = "") -> Optional[Resumed]:
        """A private copy of the state kept under `name`, if its tokens begin `ids`.
        `label`: what logs may call it (the request's PromptCache.resume_label)."""
        label = label or "a named snapshot"
        prompt = np.asarray(ids, dtype=np.uint32)
        named = self._names.get(name)
        if named is not None:
            if not self._begins(label, named.tokens, prompt):
                return None
            hit = self.prefix.state_of(named.namespace, named.tokens.tolist())
            if hit is not None:
                self._touch(name)
                self.hits_ram += 1
                return Resumed(hit.cache, hit.tokens, hit.head, tier="ram")
            self._forget(name)  # the prefix cache let it go: the disk may still have it
        snap = preloaded if preloaded is not None else (
            self.disk.load(name) if self.disk is not None else None)
        if snap is None:
            self.misses += 1
            return None
        return self._from_disk(name, label, namespace, snap, prompt)

    def _begins(self, label: str, held: np.ndarray, prompt: np.ndarray) -> bool:
        at = _first_difference(held, prompt)
        if at == len(held) and len(held) < len(prompt):
            return True
        self.fallbacks += 1
        log.debug("snapshot %s: the prompt departs from its %d tokens at position %d; "
                  "falling back to prefix matching", label, len(held), at)
        return False

    def _from_disk(self, name: str, label: str, namespace: str, snap: files.Snapshot,
                   prompt: np.ndarray) -> Optional[Resumed]:
        held = np.asarray(snap.tokens, dtype=np.uint32)
        begins = self._begins(label, held, prompt)
        try:
            cache, head = files.decode_all(snap)
        except (files.CorruptFile, ValueError, TypeError) as e:
            log.warning("a KV snapshot file did not decode (%s); deleted", e)
            self.disk.drop(name, corrupt=True)
            return None
        if cache_tokens(cache) not in (None, len(held)):
            log.warning("a KV snapshot file's state disagrees with its tokens; deleted")
            self.disk.drop(name, corrupt=True)
            return None
        if begins:
            if self.prefix.store(namespace, snap.tokens, cache, head):  # memory has it now
                self._name(name, namespace, held)
            self.hits_disk += 1
            return Resumed(copy.deepcopy(cache), len(held), copy.deepcopy(head), tier="disk")
        # The template rewrote history: what is shared still serves, if it can be trimmed.
        shared = min(_first_difference(held, prompt), len(prompt) - 1)
        if shared <= 0 or not can_trim_prompt_cache(cache):
            return None
        if trim_prompt_cache(cache, len(held) - shared) != len(held) - shared:
            return None
        return Resumed(cache, shared, tier="disk", partial=True)

    # ---- keeping (MLX thread) --------------------------------------------------------

    def keep(self, name: str, namespace: str, tokens: list[int], cache: list,
             in_memory: bool, head: Optional[list] = None) -> None:
        """A named generation ended holding `tokens` in `cache` (stored in the prefix
        cache when `in_memory`; the MTP head's state beside it: `head`): name it, and
        queue it for the disk tier."""
        if in_memory:
            self._name(name, namespace, np.asarray(tokens, dtype=np.uint32))
        if self.disk is not None:
            self.disk.put(files.encode(name, tokens, cache, head))

    def _name(self, name: str, namespace: str, tokens: np.ndarray) -> None:
        if name in self._names:
            self._forget(name)
        self._names[name] = Named(namespace, tokens, self._clock())
        self._named_tokens += len(tokens)
        while self._named_tokens > self.max_named_tokens and len(self._names) > 1:
            self._forget(next(iter(self._names)))

    def _touch(self, name: str) -> None:
        self._names[name].used_at = self._clock()
        self._names.move_to_end(name)

    def _forget(self, name: str) -> Optional[Named]:
        named = self._names.pop(name, None)
        if named is not None:
            self._named_tokens -= len(named.tokens)
        return named

    # ---- admin (MLX thread) ----------------------------------------------------------

    def entries(self) -> list[SnapshotInfo]:
        on_disk = self.disk.entries() if self.disk is not None else {}
        out = []
        for name, n in self._names.items():
            d = on_disk.pop(name, None)
            out.append(SnapshotInfo(
                name=name, tokens=len(n.tokens),
                ram_bytes=self.prefix.holds(n.namespace, n.tokens.tolist()),
                disk_bytes=d.nbytes if d else 0,
                used_at=max(n.used_at, d.used_at if d else 0.0)))
        out += [SnapshotInfo(name=name, tokens=d.tokens, disk_bytes=d.nbytes, used_at=d.used_at)
                for name, d in on_disk.items()]
        return sorted(out, key=lambda e: e.used_at, reverse=True)

    def save(self, name: str) -> tuple[bool, str]:
        """Write `name`'s state from memory to the disk tier."""
        if self.disk is None:
            return False, "the disk tier is off (--kv-disk-bytes 0)"
        named = self._names.get(name)
        hit = self.prefix.state_of(named.namespace, named.tokens.tolist()) if named else None
        if hit is None:
            if self.disk.has(name):
                return True, f"{name} is on disk already"
            return False, f"no snapshot named {name} in memory"
        enc = files.encode(name, named.tokens.tolist(), hit.cache, hit.head)
        if not self.disk.put(enc):
            return False, (f"{name} ({enc.nbytes} bytes) does not fit the disk tier now "
                           f"(--kv-disk-bytes {self.disk.max_bytes}, or writes are behind)")
        return True, f"writing {name} ({enc.nbytes} bytes) to disk"

    def drop(self, name: str) -> bool:
        named = self._forget(name)
        if named is not None:
            self.prefix.drop(named.namespace, named.tokens.tolist())
        on_disk = self.disk.drop(name) if self.disk is not None else False
        return named is not None or on_disk

    def clear(self) -> int:
        """Forget every snapshot, in memory (with the whole prefix cache) and on disk."""
        count = len({*self._names, *(self.disk.entries() if self.disk else {})})
        self._names.clear()
        self._named_tokens = 0
        self.prefix.clear()
        if self.disk is not None:
            self.disk.clear()
        return count

    def stats(self) -> SnapshotStats:
        disk = self.disk.stats() if self.disk is not None else {}
        return SnapshotStats(hits_ram=self.hits_ram, hits_disk=self.hits_disk,
                             misses=self.misses, fallbacks=self.fallbacks,
                             named=len(self._names), **disk)
