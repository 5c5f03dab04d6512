"""Verifying drafts on a hybrid model (Qwen3.5, Qwen3-Next: GatedDeltaNet layers between
attention layers), whose recurrent state cannot be trimmed back like attention KV.

A verify step feeds each row its pending token and its draft; a row that rejects part
of its draft must keep the recurrent state as it was after its last kept position, not
after the whole draft. While a verify step runs (`start` to `done`), each recurrent layer
takes its positions one at a time (what a plain decode step does anyway: the same
arithmetic) and keeps its state (the convolution's window and the delta rule's matrix)
after each; `keep` then gives every row of every recurrent cache the state at its own
kept length. No second forward pass; a verify step's recurrent layers cost `width`
small calls instead of one.

The layers are found by the caches they are handed (mlx-lm's `ArraysCache`), so any
family whose recurrent layer is called as `layer(x, mask, cache)` with its whole state in
that cache works; `install` patches each such layer class once and says whether the
model's every cache is one that can be brought back (attention KV or recurrent state).
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

_record: dict | None = None   # id(cache) -> (cache, [state after each position])


def install(model) -> bool:
    """Patch the recurrent layer classes of `model` (once); whether every cache of the
    model is attention KV or recurrent state a verify step can bring back."""
    caches = make_prompt_cache(model)
    kinds = {type(c) for c in caches}
    if not kinds <= {KVCache, ArraysCache}:
        return False
    if ArraysCache not in kinds:
        return True
    layers = getattr(model, "layers", None) or []
    found = set()
    for layer, cache in zip(layers, caches):
        if type(cache) is ArraysCache:
            inner = getattr(layer, "linear_attn", None)
            if inner is None:
                return False
            found.add(type(inner))
    for cls in found:
        _patch(cls)
    return bool(found)


def _patch(cls) -> None:
    original = cls.__call__
    if getattr(original, "mlxd_recording", False):
        return

    @functools.wraps(original)
    def __call__(self, inputs, mask=None, cache=None):
        width = inputs.shape[1]
        if _record is None or cache is None or width == 1:
            return original(self, inputs, mask, cache)
        outs, states = [], []
        for j in range(width):
            outs.append(original(self, inputs[:, j:j + 1],
                                 None if mask is None else mask[:, j:j + 1], cache))
            states.append(list(cache.cache))
        _record[id(cache)] = (cache, states)
        return mx.concatenate(outs, axis=1)

    __call__.mlxd_recording = True
    cls.__call__ = __call__


def start() -> None:
    """Recurrent layers keep their state after each position of the forward passes run
    from now until `done` (`keep` uses them)."""
    global _record
    _record = {}


def recorded(cache) -> bool:
    return _record is not None and id(cache) in _record


def keep(cache, rejected: list[int]) -> None:
    """Row i of `cache` (a recurrent cache the recorded forward ran) as it was before
    its last `rejected[i]` positions."""
    _, states = _record[id(cache)]
    rows = mx.arange(len(rejected))
    at = mx.array([len(states) - 1 - r for r in rejected])
    for slot in range(len(cache.cache)):
        stacked = mx.stack([s[slot] for s in states])  # (width, rows, ...)
        cache.cache[slot] = stacked[at, rows]


def done() -> None:
    global _record
    _record = None
