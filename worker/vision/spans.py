"""An image prompt's prefill in chunks where its image tokens attend each other both ways
(Gemma 4: `use_bidirectional_attention: "vision"`, told by the processor's token types).

mlx-vlm refuses to chunk such a prefill (its `chunked_prefill_policy`) and runs it whole,
so the batch's running streams would wait for the whole prompt in one step. Only an
image's own tokens need to be in one chunk: a token before the image never sees it, and
a token after it sees it causally, as in a chunk of its own. So the prompt is cut
anywhere but inside an image's span (`cut`), each span in one chunk, longer than the
chunk size if it must be.

mlx-vlm's overlay that lets a span's tokens see each other (`Gemma4TextModel.
_apply_blockwise_bidirectional_overlay`) only takes a square mask, a chunk with nothing
before it in the cache; after a prefix its mask has a column per cached token as well,
and it left the mask causal. `install` extends it to that mask: the chunk's own tokens
are its last columns (a plain cache appends them, a rotating one keeps its window then
appends them), and the spans lie within the chunk, so the overlay goes on those columns.
For a square mask it is mlx-vlm's own.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

VISUAL = (1, 2)  # the token types of an image's and a video's tokens


def spans(types) -> list[tuple[int, int]]:
    """The [start, end) runs of visual tokens in a (1, n) array of token types."""
    visual = np.isin(np.asarray(types).reshape(-1), VISUAL).astype(np.int8)
    edges = np.diff(np.concatenate([[0], visual, [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def cut(a: int, b: int, whole: list[tuple[int, int]]) -> int:
    """Where a chunk from `a` meant to end at `b` ends so that no span of `whole` is cut:
    before a span that `b` falls in, or, if the span starts the chunk (or started
    before it: the cache holds its first tokens), at its end."""
    for s, e in whole:
        if s < b < e:
            return s if s > a else e
    return b


def install() -> None:
    """Gemma 4's bidirectional overlay on a chunk after a cached prefix (module doc)."""
    from mlx_vlm.models.gemma4.language import Gemma4TextModel

    original = Gemma4TextModel._apply_blockwise_bidirectional_overlay
    if getattr(original, "mlxd_prefix", False):
        return

    def overlay(self, base_mask, mm_token_type_ids):
        if mm_token_type_ids is None or not isinstance(base_mask, mx.array):
            return original(self, base_mask, mm_token_type_ids)
        q, k = base_mask.shape[-2:]
        if q == k or mm_token_type_ids.shape[1] != q or k < q:
            return original(self, base_mask, mm_token_type_ids)
        ids = self._block_sequence_ids_for_mask(mm_token_type_ids)
        same = (ids[:, :, None] != -1) & (ids[:, :, None] == ids[:, None, :])
        before = mx.zeros((*same.shape[:2], k - q), dtype=same.dtype)
        return base_mask | mx.expand_dims(mx.concatenate([before, same], axis=-1), 1)

    overlay.mlxd_prefix = True
    Gemma4TextModel._apply_blockwise_bidirectional_overlay = overlay
