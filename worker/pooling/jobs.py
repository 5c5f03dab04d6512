"""A pooling request as the worker runs it: its inputs tokenized, run in padded batches,
its rows collected in input order.

The inputs are sorted by length and cut into batches of at most `MAX_ROWS` rows and
`TOKENS_PER_STEP` padded tokens, so short inputs are not padded to a long one's length and
one step stays short enough for a Cancel to be seen soon.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOKENS_PER_STEP = 8192
MAX_ROWS = 64


@dataclass
class Job:
    gen: object                      # the protocol Generate
    rows: list[list[int]]            # token ids per input, in input order
    dim: int                         # width of each result row
    types: list[list[int]] | None = None  # token type (segment) ids per row, if the model
    #                                        reads pairs as two segments (BERT)
    out: np.ndarray | None = None    # (len(rows), dim) float32, filled batch by batch
    _order: list[int] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self):
        self._order = sorted(range(len(self.rows)), key=lambda i: len(self.rows[i]))
        self.out = np.zeros((len(self.rows), self.dim), dtype=np.float32)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def finished(self) -> bool:
        return self._next >= len(self._order)

    def next_batch(self) -> list[int]:
        """The indices of the next batch: consecutive by length, within the limits."""
        batch: list[int] = []
        while self._next < len(self._order) and len(batch) < MAX_ROWS:
            i = self._order[self._next]
            longest = len(self.rows[i])  # sorted: this row is the longest so far
            if batch and longest * (len(batch) + 1) > TOKENS_PER_STEP:
                break
            batch.append(i)
            self._next += 1
        return batch

    def batch(self, indices: list[int]) -> tuple[list[list[int]], list[list[int]] | None]:
        """The rows of `indices`, and their token types if the job has them."""
        rows = [self.rows[i] for i in indices]
        return rows, [self.types[i] for i in indices] if self.types is not None else None

    def store(self, indices: list[int], values: np.ndarray) -> None:
        self.out[indices] = values


def padded(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids and their mask (1 for a real token), as int32 arrays."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask
