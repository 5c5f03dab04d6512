"""The loop of every rank but the leader: replay what the leader did to its batch.

Each message (worker/group/control.py) holds the leader's operations since the last one, in order (leader.py):
`add` (a request, prepared here as the leader prepared it), `rm`, `step` (with the chunk
size the leader's timing chose, and the checksum of the leader's previous step),
`reset` (after a failed step: a fresh batch, and the same proof that a step runs),
`cache` (named snapshots), `ping` and `stop`. This rank's own outputs are not sent
anywhere: the leader streams them.

Divergence is fatal, never silent: a request this rank prepares differently, a cached
prefix of a different length, a step whose tokens differ from the leader's, or a step
that failed here and not there: the follower raises `Diverged`, exits, and the leader's
next collective fails, so the supervisor replaces the whole group.
"""

from __future__ import annotations

import logging
import time

import msgpack

from protocol.codec import decode_down
from worker.text.engine import Prepared
from worker.group.leader import checksum
from worker.loop.preparer import prepare

log = logging.getLogger("worker.group.follower")

RELEASE_AFTER_IDLE = 2.0  # s: as the leader's scheduler gives MLX's buffer cache back


class Diverged(Exception):
    """This rank's batch no longer matches the leader's."""


class _Seq:
    """A follower's stand-in for the scheduler's Sequence."""
    __slots__ = ("rid", "uid", "stop_sequence")

    def __init__(self, rid: str):
        self.rid, self.uid, self.stop_sequence = rid, None, None


class Follower:
    def __init__(self, engine, batch, control, clock=time.monotonic):
        self.engine = engine
        self.batch = batch
        self.control = control
        self._clock = clock
        self.seqs: dict[str, _Seq] = {}
        self.check: int | None = None
        self.failed = False          # the last step raised here
        self.steps = 0
        self._busy_at = clock()

    def run(self) -> None:
        """Until the leader says stop (or a collective fails: the leader is gone)."""
        self._publish_memory()  # from the first beat on: a rank idle since ready too
        while True:
            ops = msgpack.unpackb(self.control.receive(), raw=False)
            for op in ops:
                if not self.apply(op):
                    return
            self._publish_memory()

    def _publish_memory(self) -> None:
        """This rank's MLX memory for its heartbeats (only this thread calls MLX; the beat
        thread sends what it reads here)."""
        import mlx.core as mx

        self.control.memory = (mx.get_active_memory(), mx.get_peak_memory())

    def apply(self, op: list) -> bool:
        """One of the leader's operations; False after `stop`."""
        kind = op[0]
        if self.failed and kind not in ("reset", "stop"):
            raise Diverged("a step failed on this rank and not on the leader")
        if kind == "add":
            self._add(decode_down(op[1]), op[2])
        elif kind == "rm":
            seq = self.seqs.pop(op[1], None)
            if seq is not None:
                self.batch.remove(seq)
        elif kind == "step":
            self._step(op[1], op[2])
        elif kind == "reset":
            self.failed, self.check = False, None
            self.seqs.clear()
            self.batch.reset()
            self.engine.recover()
        elif kind == "cache":
            self._cache(op[1], op[2])
        elif kind == "ping":
            self._idle()
        elif kind == "stop":
            self.batch.close()
            return False
        else:
            raise Diverged(f"unknown operation {kind!r} (a leader of another version?)")
        if kind != "ping":
            self._busy_at = self._clock()
        return True

    def _add(self, gen, leader_cached: int) -> None:
        prep = prepare(self.engine, self.batch.kvcache, gen)
        if not isinstance(prep, Prepared):
            raise Diverged(f"rid={gen.rid}: the leader generates, this rank would not")
        seq = _Seq(gen.rid)
        cached = self.batch.add(seq, prep)
        if cached != leader_cached:
            raise Diverged(f"rid={gen.rid}: {cached} cached prompt tokens here, "
                           f"{leader_cached} on the leader")
        self.seqs[seq.rid] = seq

    def _step(self, chunk: int, leader_check: int | None) -> None:
        if leader_check is not None and self.check is not None and leader_check != self.check:
            raise Diverged("the last step's tokens differ from the leader's")
        chunks = self.batch.chunks
        if chunks.size != chunk:  # the leader's timing decides, for every rank
            chunks.size = chunk
            self.batch._set_chunk(chunk)
        self.check = None
        try:
            results = self.batch.step()
        except Exception:
            # The leader's step failed too (its reset comes next), or this rank diverged
            # (anything else comes next): `apply` tells which.
            log.exception("a step failed on this rank")
            self.failed = True
            return
        self.steps += 1
        self.check = checksum(results)
        members = self.batch.members
        for rid in [rid for rid, s in self.seqs.items() if s.uid not in members]:
            del self.seqs[rid]   # ended inside the step (EOS, length, stop string)

    def _cache(self, op: str, name) -> None:
        store = self.batch.kvcache
        if store is None:
            return
        if op == "save":
            store.save(name)
        elif op == "drop":
            store.drop(name)
        elif op == "clear":
            store.clear()

    def _idle(self) -> None:
        if not self.seqs and self._clock() - self._busy_at >= RELEASE_AFTER_IDLE:
            import mlx.core as mx

            mx.clear_cache()
            self._busy_at = float("inf")   # once per idle period
