"""The batch the leader's scheduler drives: the real batch, plus what the followers must
replay of it.

The scheduler does not know it leads a group: it calls `add`, `remove`, `step`, `reset`
as on any batch. Adding and removing touch only this rank's batch (no forward pass, so no
collective), and are recorded; `step` sends the record with the step itself (the prefill
chunk size this rank's timing chose, and a checksum of the previous step's tokens) in one
message over the control channel (control.py), then steps: the step's own collectives
keep the ranks in lockstep. `idle` flushes what was recorded while nothing runs (the
followers give the KV of cancelled requests back) and pings once a second.

Anything that changes what a later step computes must pass through here: the prompt
cache's named snapshots too (`kvcache`, a recording view of the batch's KV cache manager).
"""

from __future__ import annotations

import re
import time
import zlib

import msgpack

from protocol.codec import encode
from worker.errors import WorkerBroken

PING_EVERY = 1.0   # s between pings while idle


class GroupLost(WorkerBroken):
    """A collective failed: a rank died or the link broke. Only a new group can serve (the
    scheduler lets it through: no request is to blame)."""


# How MLX's backends word a failed collective ("[ring] connection to a peer was lost").
_LINK_ERRORS = re.compile(r"^\[(ring|jaccl|mpi|nccl)\]", re.IGNORECASE)


def is_link_failure(e: BaseException) -> bool:
    """A step that failed because another rank or the link did, not because of a request:
    the scheduler must not end requests with an error and carry on (it would look for a
    culprit among them); the group is replaced, and their clients may retry."""
    return isinstance(e, RuntimeError) and bool(_LINK_ERRORS.match(str(e)))


def checksum(results) -> int:
    """What a step produced, per sequence, as one number every rank can compare."""
    parts = []
    for seq, out in results:
        if isinstance(out, Exception):
            parts.append(f"{seq.rid}:E")
        else:
            parts.append(f"{seq.rid}:{out[0]}:{out[2]}")
    return zlib.crc32(";".join(parts).encode())


class LeaderBatch:
    # An echo's scoring pass runs the model outside a step, where the followers would not
    # follow (worker/loop/echo.py): refused.
    scores_prompts = False
    # The followers prefill in the segments the request alone gives them: a prompt's
    # state kept for its repeats (worker/loop/batch.py `same`) would part the ranks' steps.
    shares_prompts = False

    def __init__(self, batch, control, clock=time.monotonic, faults=None):
        self.inner = batch
        self.control = control
        self.faults = faults  # worker/faults.py: tests only, else None
        self._clock = clock
        self.pending: list = []
        self.check: int | None = None   # the last step's checksum (None: none to compare)
        self._sent_at = clock()
        self._kvcache = (_RecordingKVCache(batch.kvcache, self.pending)
                         if batch.kvcache is not None else None)

    def __getattr__(self, name):  # what only reads: fits, need, max_size, cache_stats...
        return getattr(self.inner, name)

    @property
    def kvcache(self):
        return self._kvcache

    def send(self, *ops) -> None:
        """Everything recorded, then `ops`, to every rank in one message."""
        message = msgpack.packb(self.pending + list(ops), use_bin_type=True)
        self.pending.clear()
        try:
            self.control.send(message)
        except ConnectionError as e:
            raise GroupLost(str(e)[:200]) from e
        self._sent_at = self._clock()

    # ---- what changes the batch -----------------------------------------------------

    def add(self, seq, prep) -> int:
        cached = self.inner.add(seq, prep)
        # The request itself (the protocol's own encoding): a follower prepares it as
        # this rank did, and must find the same cached prefix.
        self.pending.append(["add", encode(prep.gen), cached])
        return cached

    def remove(self, seq) -> None:
        if getattr(seq, "uid", None) in self.inner.members:
            self.pending.append(["rm", seq.rid])
        self.inner.remove(seq)

    def step(self) -> list:
        self.send(["step", self.inner.chunks.size, self.check])
        self.check = None
        try:
            results = self.inner.step()  # (raises: the scheduler resets, see `reset`)
        except Exception as e:
            if is_link_failure(e):
                if self.faults is not None:
                    self.faults.group_lost()
                raise GroupLost(str(e)[:200]) from e
            raise
        self.check = checksum(results)
        return results

    def reset(self) -> list:
        """After a failed step: every rank drops its batch and proves a step runs (the
        scheduler calls `engine.recover` next, the followers with the same op)."""
        self.check = None
        self.pending.clear()  # (what the dropped sequences did no longer matters)
        self.send(["reset"])
        return self.inner.reset()

    def idle(self) -> None:
        """Between requests: a ping once a second (and what was recorded since)."""
        if self.pending or self._clock() - self._sent_at >= PING_EVERY:
            self.send(["ping"])

    def close(self, lost: bool = False) -> None:
        """Shutdown: the followers stop too. `lost`: the group lost a rank, and nothing
        more of MLX runs here (the batch is left as it is; the process exits next): its
        streams may wait forever on the rest of a failed step's collectives, and closing
        the batch waits for them (mlx-lm's generator synchronizes its stream on Metal,
        holding the GIL: no thread of this process would run again)."""
        try:
            self.send(["stop"])
        except GroupLost:
            pass  # a rank already gone: nothing to tell it
        if not lost:
            self.inner.close()


class _RecordingKVCache:
    """The batch's KV cache manager as the scheduler sees it (its cache commands, the
    preparation's preload): what changes the named snapshots (and so later prompt-cache
    hits) is recorded for the followers."""

    def __init__(self, store, pending: list):
        self._store = store
        self._pending = pending

    def __getattr__(self, name):  # entries, stats, preload: reads
        return getattr(self._store, name)

    def save(self, name: str):
        self._pending.append(["cache", "save", name])
        return self._store.save(name)

    def drop(self, name: str):
        self._pending.append(["cache", "drop", name])
        return self._store.drop(name)

    def clear(self):
        self._pending.append(["cache", "clear", None])
        return self._store.clear()
