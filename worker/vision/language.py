"""A vision-language checkpoint's language model as mlx-lm's own text model, sharing the
weights mlx-vlm loaded, so that the checkpoint's requests run on the text batch
(worker/loop/batch.py, mlx-lm's BatchGenerator) with everything text requests have.

Why two model objects: mlx-vlm's model holds the vision tower and the step that merges an
image's features into the prompt's embeddings (and, for Qwen's multimodal rotary
positions, the 3-D positions of the image's tokens); mlx-lm's text class of the same
family (qwen2_vl, qwen3_5, gemma3, mistral3, ...: they drop the vision weights) is what
mlx-lm's BatchGenerator, its batch caches and mlxd's patches of them are built for.
`shared_language_model` builds the mlx-lm class from the checkpoint's config with lazy
weights and replaces every one of them with mlx-vlm's array of the same name: the
weights are in memory once. A checkpoint whose names or shapes do not line up (or whose
family mlx-lm lacks, or whose caches are not `CARRIED`) gets None, and keeps the
one-at-a-time path (worker/vision/serial.py).

`Positions` is the one thing the text class lacks: Qwen's multimodal rotary positions
advance an image by its grid's side, not by its token count, so every token after an
image sits at its index plus a per-sequence delta (mlx-vlm's `rope_deltas`, negative).
mlx-lm's attention rotates by the cache's offset (per row in a batch cache), so each
rotary module is wrapped to add the rows' deltas; the batch tells which rows a forward
pass runs (`rows`, set by worker/vision/batch.py around mlx-lm's two forward calls). A
batch where no row has a delta runs mlx-lm's rotation untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

log = logging.getLogger("worker.vision")


# The cache classes whose state an image's prefill hands from mlx-vlm's step to the
# batch (worker/vision/batch.py `_carry`): attention KV, a sliding window's (Gemma 3's
# local layers, `--max-kv-size`) and recurrent arrays.
CARRIED = frozenset((KVCache, RotatingKVCache, ArraysCache))


def shared_language_model(vlm, path: Path) -> Optional[nn.Module]:
    """mlx-lm's text model of the checkpoint at `path`, its weights mlx-vlm's (`vlm`'s)
    arrays; None (with the reason logged) where mlx-lm has no such class or a weight
    does not line up."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import load_model

    try:
        lm, _ = load_model(Path(path), lazy=True)  # (lazy: no weight is read)
    except Exception as e:  # an unknown family, a config mlx-lm reads otherwise
        log.info("mlx-lm has no text model for this checkpoint (%s): one request at a "
                 "time", type(e).__name__)
        return None
    theirs = dict(tree_flatten(vlm.parameters()))
    mine = dict(tree_flatten(lm.parameters()))
    off = [k for k, v in mine.items()
           if k not in theirs or theirs[k].shape != v.shape or theirs[k].dtype != v.dtype]
    if off:
        log.info("mlx-lm's text model and mlx-vlm's differ in %d weights (%s, ...): one "
                 "request at a time", len(off), off[0])
        return None
    kinds = {type(c) for c in make_prompt_cache(lm)}
    if not kinds <= CARRIED:
        log.info("the language model keeps caches the image prefill cannot hand over "
                 "(%s): one request at a time", ", ".join(sorted(k.__name__ for k in kinds)))
        return None
    lm.update(tree_unflatten([(k, theirs[k]) for k in mine]))
    lm.eval()
    lm.mlxd_positions = Positions(lm)
    return lm


class _ShiftedRope(nn.Module):
    """A rotary module whose offset is moved by the rows' position deltas (when any)."""

    def __init__(self, rope, positions: "Positions"):
        super().__init__()
        self.inner = rope
        self._positions = [positions]  # (a list: not a child module)

    def __call__(self, x, offset=0):
        delta = self._positions[0].delta
        if delta is None:
            return self.inner(x, offset=offset)
        return self.inner(x, offset=offset + delta)


class Positions:
    """The per-sequence position deltas of the rows a forward pass runs (module doc)."""

    def __init__(self, model: nn.Module):
        self.deltas: dict[int, int] = {}   # uid → delta (rows without one: 0)
        self.delta: Optional[mx.array] = None
        self.wrapped = 0
        for _, module in model.named_modules():
            rope = getattr(module, "rope", None)
            if isinstance(rope, nn.Module) and not isinstance(rope, _ShiftedRope):
                module.rope = _ShiftedRope(rope, self)
                self.wrapped += 1

    def rows(self, uids) -> None:
        """The next forward pass runs these sequences' rows, in this order."""
        if not self.deltas:
            self.delta = None
            return
        shifts = [self.deltas.get(u, 0) for u in uids]
        self.delta = mx.array(shifts, dtype=mx.int32) if any(shifts) else None

    def done(self) -> None:
        """The pass told by `rows` has its offsets in its graph: no later forward (one
        outside any batch, such as KVSize.measure's, with another row count) reads them."""
        self.delta = None

    def clear(self) -> None:
        self.deltas.clear()
        self.delta = None
