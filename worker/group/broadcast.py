"""Bytes from rank 0 to every rank, carried by the group's own collective.

MLX's distributed layer has no broadcast; `all_sum` is one when only rank 0 contributes
(the others add zeros). A message is one fixed-size frame (a 4-byte length, then the
payload): most (a step's composition) fit in it, so a step costs one collective; a longer
one (a request's prompt) follows in a second collective sized to the rest. Every rank
calls `exchange` in the same order: the leader with its message, the others with None.

Used while the group starts (worker/group/setup.py: the seed, every host's figures, the
load barrier); a serving group's operations travel over ZeroMQ (control.py says why).
"""

from __future__ import annotations

import struct
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

FRAME = 4096                   # bytes of the first collective of every message
_HEAD = struct.Struct("<I")    # the payload's length


class Broadcast:
    def __init__(self, group, *, stream=None, all_sum: Optional[Callable] = None):
        """`stream`: where the collective runs (setup.py says why it is the model's).
        `all_sum`: tests inject one."""
        self.group = group
        self.rank = group.rank()
        self.stream = stream
        self._all_sum = all_sum or self.all_sum

    def all_sum(self, array):
        """`array` summed over the group on the channel's stream, evaluated."""
        kw = {"stream": self.stream} if self.stream is not None else {}
        out = mx.distributed.all_sum(array, group=self.group, **kw)
        mx.eval(out)
        return out

    def _sum(self, data: bytes, size: int) -> bytes:
        buf = bytearray(size)
        buf[:len(data)] = data
        out = self._all_sum(mx.array(np.frombuffer(bytes(buf), dtype=np.uint8)))
        return np.asarray(out, dtype=np.uint8).tobytes()

    def exchange(self, message: Optional[bytes] = None) -> bytes:
        """Rank 0 passes its message (and gets it back); the others pass None and get it."""
        if self.rank == 0:
            if message is None:
                raise ValueError("rank 0 must send a message")
            first = _HEAD.pack(len(message)) + message[:FRAME - _HEAD.size]
            self._sum(first, FRAME)
            rest = message[FRAME - _HEAD.size:]
            if rest:
                self._sum(rest, len(rest))
            return message
        frame = self._sum(b"", FRAME)
        (length,) = _HEAD.unpack_from(frame)
        body = frame[_HEAD.size:_HEAD.size + length]
        missing = length - len(body)
        if missing > 0:
            body += self._sum(b"", missing)
        return body

    def gather(self, data: bytes, size: int = 512) -> list[bytes]:
        """Every rank's `data` (at most `size - 4` bytes), in rank order, on every rank:
        what each host reports of itself (memory, name)."""
        if len(data) > size - _HEAD.size:
            raise ValueError(f"{len(data)} bytes do not fit a {size}-byte row")
        row = bytearray(size * self.group.size())
        offset = self.rank * size
        row[offset:offset + _HEAD.size + len(data)] = _HEAD.pack(len(data)) + data
        out = self._sum(bytes(row), len(row))
        rows = []
        for r in range(self.group.size()):
            (n,) = _HEAD.unpack_from(out, r * size)
            rows.append(out[r * size + _HEAD.size:r * size + _HEAD.size + n])
        return rows
