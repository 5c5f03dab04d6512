"""A drafter's batch cache: rows by owner in one mlx-lm BatchKVCache per layer.

Both drafters that run a model of their own inside the batch (a draft model:
draft_model.py; the checkpoint's MTP head: mtp.py) keep every sequence drafting with it
as a row of ONE batch cache, so that a draft is a pass for all of them, not one per
sequence. Their rows follow the target's sequences, which join and leave mlx-lm's batch
at any step: a row joins by `BatchKVCache.extend` (left-padded to the longest), leaves by
`filter`, and a pass over some rows' new positions is right-padded to the longest and the
padding then rolled into each row's left padding (mlx-lm's own `prepare`/`finalize`, as
its prefill pads). `Rows` is that bookkeeping, once.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


class Rows:
    """The owners of a batch cache's rows, in order, and the cache (one BatchKVCache per
    layer; [] while it has no rows)."""

    def __init__(self):
        self.order: list = []
        self.cache: list = []

    def __contains__(self, owner) -> bool:
        return owner in self.order

    def __len__(self) -> int:
        return len(self.order)

    @property
    def nbytes(self) -> int:
        """The bytes its cache holds (every row's allocated positions)."""
        return sum(c.nbytes for c in self.cache)

    def join(self, owners: list, cache: list) -> None:
        """Rows for `owners`, whose own caches `cache` holds (one BatchKVCache per layer,
        a row each), appended after the others."""
        if self.cache:
            for mine, new in zip(self.cache, cache):
                mine.extend(new)
        else:
            self.cache = cache
        self.order.extend(owners)

    def keep(self, owners) -> None:
        """Only the rows of `owners` stay (in their order)."""
        keep = [i for i, o in enumerate(self.order) if o in owners]
        if len(keep) == len(self.order):
            return
        self.order = [self.order[i] for i in keep]
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)

    def leave(self, owner) -> None:
        if owner in self.order:
            self.keep([o for o in self.order if o != owner])

    def clear(self) -> None:
        self.order, self.cache = [], []

    def run(self, lengths: list, call):
        """`call()`: a pass over each row's `lengths[i]` new positions, right-padded to
        the longest (a row with none reads only padding); the padding is then rolled into
        the rows' left padding. Returns its output at each row's last new position (rows,
        1, ...)."""
        pad = [max(lengths) - n for n in lengths]
        if any(pad):
            for c in self.cache:
                c.prepare(right_padding=pad)
        out = call()
        if not any(pad):
            return out[:, -1:]
        for c in self.cache:
            c.finalize()
        last = mx.array([max(0, n - 1) for n in lengths])
        return mx.take_along_axis(out, last[:, None, None], axis=1)

    def compact(self) -> None:
        """Each row's positions laid out again, left-padded to the longest
        (BatchKVCache.merge): the padding the passes left goes."""
        rows = len(self.order)
        self.cache = [BatchKVCache.merge([c.extract(i) for i in range(rows)])
                      for c in self.cache]
