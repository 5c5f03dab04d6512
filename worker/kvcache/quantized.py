"""A quantized KV cache that continuous batching, the prefix cache and the KV tiers can
use (`--kv-bits`, `--kv-group-size`): the attention layers' keys and values are stored as
MLX's affine quantization (packed integers, a scale and a bias per group), 8 bits about
half and 4 bits about a quarter of half precision's bytes, so the same `--kv-budget`
holds 2-4 x the tokens.

mlx-lm has the single-sequence cache (`QuantizedKVCache`) and the attention that reads it
(`models/base.py`: `quantized_scaled_dot_product_attention`, by `mx.quantized_matmul`,
chosen for any cache with `bits`), but its BatchGenerator has no batched one: it merges
the sequences' caches into a batch by the first one's `merge`, which QuantizedKVCache
lacks. mlx-vlm 0.7 ships the batched cache (`BatchQuantizedKVCache`: left padding, the
right padding of a multi-prompt prefill, `extend`, `filter`, `extract` as mlx-lm's
BatchKVCache); this module adds what mlx-lm's BatchGenerator needs around it: a `merge`
(and `size`) on mlx-lm's QuantizedKVCache, an `extract` that gives mlx-lm's
QuantizedKVCache back (so a sequence's state in the prefix cache, a snapshot and its file
are mlx-lm's own class: `load_prompt_cache` reads them), and `KVFormat`: which layers of a
model's cache are quantized (its attention layers; a recurrent layer's state stays at
full precision), checked once at load so that a model whose cache or attention cannot
hold quantized keys is a load error, never silently full precision.

(The per-sequence quantization start of mlx-lm's generate, `--quantized-kv-start`, is not
here: a batch's layers are one array per layer for every row, so a row cannot be plain
while its neighbours are quantized.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import (CacheList, ChunkedKVCache, KVCache, QuantizedKVCache,
                                 RotatingKVCache, create_attention_mask, make_prompt_cache)

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)   # what mx.quantize accepts


class FormatError(ValueError):
    """A model and a KV format that cannot go together (a load error)."""


@dataclass(frozen=True)
class KVFormat:
    """How attention keys and values are stored: `bits` None is full precision."""
    bits: Optional[int] = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def tag(self) -> str:
        """The format in a snapshot's identity: "" for full precision (identities of
        full-precision snapshots are what they always were), else "q8g64"."""
        return f"q{self.bits}g{self.group_size}" if self.quantized else ""

    def make(self, model, max_kv_size: Optional[int] = None) -> list:
        """A fresh cache for one sequence: the model's own, its attention layers
        quantized."""
        cache = make_prompt_cache(model, max_kv_size)
        if not self.quantized:
            return cache
        install()
        return self.convert(cache)

    def convert(self, cache: list) -> list:
        return [self._layer(c) for c in cache]

    def _layer(self, c):
        if isinstance(c, CacheList):
            return CacheList(*(self._layer(x) for x in c.caches))
        if isinstance(c, (RotatingKVCache, ChunkedKVCache)):
            raise FormatError(f"--kv-bits: this model's {type(c).__name__} layers (a "
                              "sliding window, or --max-kv-size) cannot hold a quantized KV "
                              "cache yet; leave --kv-bits unset")
        if type(c) is KVCache:
            if c.keys is not None:
                return c.to_quantized(group_size=self.group_size, bits=self.bits)
            return QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        return c  # a recurrent layer's state (ArraysCache): full precision

    def check(self, model, max_kv_size: Optional[int] = None, model_type: str = "") -> None:
        """Raise FormatError unless `model` can run on this format: valid bits and group
        size, a cache whose attention layers can be quantized, an attention that reads
        them (one token's forward pass), a head dimension the group size divides."""
        if not self.quantized:
            return
        if self.bits not in BITS:
            raise FormatError(f"--kv-bits {self.bits}: choose one of "
                              f"{', '.join(map(str, BITS))}")
        if self.group_size not in GROUP_SIZES:
            raise FormatError(f"--kv-group-size {self.group_size}: choose one of "
                              f"{', '.join(map(str, GROUP_SIZES))}")
        plain = make_prompt_cache(model, max_kv_size)
        model(mx.array([[0]]), cache=plain)
        dims = {a.shape[-1] for c in _flat(plain) if type(c) is KVCache and c.keys is not None
                for a in (c.keys, c.values)}
        if any(d % self.group_size for d in dims):
            raise FormatError(f"--kv-bits: --kv-group-size {self.group_size} does not divide "
                              f"this model's head dimension ({', '.join(map(str, sorted(dims)))}"
                              "); choose a group size that does, or leave --kv-bits unset")
        cache = self.make(model, max_kv_size)
        if not any(isinstance(c, QuantizedKVCache) for c in _flat(cache)):
            raise FormatError(f"--kv-bits: this model ({model_type or 'its family'}) has no "
                              "attention KV cache to quantize; leave --kv-bits unset")
        try:  # (8 tokens: MLX's CUDA quantized_matmul has no kernel for one key)
            model(mx.zeros((1, 8), dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
        except Exception as e:
            raise FormatError(f"--kv-bits: {model_type or 'this model family'}'s attention "
                              f"cannot read a quantized KV cache on this device "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                              "; leave --kv-bits unset") from None


def _flat(cache):
    for c in cache:
        if isinstance(c, CacheList):
            yield from _flat(c.caches)
        else:
            yield c


_BATCH = None


def _vlm_cache():
    """mlx-vlm's `models/cache.py`. The module needs nothing but MLX, while importing it
    as `mlx_vlm.models.cache` first runs mlx-vlm's package `__init__`, its whole
    generation stack (seconds of imports, and packages a GPU host's image lacks): it is
    loaded from its file alone, and imported the ordinary way only if that fails."""
    import importlib.util
    import sys

    if "mlx_vlm.models.cache" in sys.modules:
        return sys.modules["mlx_vlm.models.cache"]
    try:
        spec = importlib.util.find_spec("mlx_vlm")  # (finds the package, imports nothing)
        origin = spec.submodule_search_locations[0]
        spec = importlib.util.spec_from_file_location("mlxd_vlm_cache",
                                                      f"{origin}/models/cache.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:
        import mlx_vlm.models.cache as module
        return module


def _batch_class():
    """mlx-vlm's batched cache, loaded on first use (a worker without --kv-bits never
    does), with what mlx-lm's batch needs added."""
    global _BATCH
    if _BATCH is not None:
        return _BATCH

    class BatchQuantizedKV(_vlm_cache().BatchQuantizedKVCache):
        def extract(self, idx: int) -> QuantizedKVCache:
            """One row as mlx-lm's QuantizedKVCache, exactly its tokens long."""
            cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
            if self.keys is None or self._idx == 0:
                return cache
            padding = int(self.left_padding[idx].item())
            cache.keys = tuple(mx.contiguous(k[idx: idx + 1, :, padding: self._idx])
                               for k in self.keys)
            cache.values = tuple(mx.contiguous(v[idx: idx + 1, :, padding: self._idx])
                                 for v in self.values)
            cache.offset = cache.keys[0].shape[2]
            return cache

        @classmethod
        def merge(cls, caches: list) -> "BatchQuantizedKV":
            """Single-sequence caches as one batch, left-padded to the longest: one row
            each, joined by `extend` (which pads them to one length)."""
            first = caches[0]
            rows = []
            for c in caches:
                if (c.bits, c.group_size) != (first.bits, first.group_size):
                    raise ValueError("caches of different KV formats cannot share a batch")
                row = cls([0], group_size=first.group_size, bits=first.bits)
                if c.keys is not None and c.offset > 0:
                    row.keys = tuple(k[..., : c.offset, :] for k in c.keys)
                    row.values = tuple(v[..., : c.offset, :] for v in c.values)
                    row._idx = c.offset
                    row.offset = mx.array([c.offset])
                rows.append(row)
            out = rows[0]
            for row in rows[1:]:
                out.extend(row)
            return out

        def make_mask(self, N: int, return_array: bool = False, **kwargs):
            """A batch of one has no left padding: the plain cache's masks (none for a
            decode step), as mlxd gives mlx-lm's BatchKVCache (worker/loop/
            mlx_lm_patches.py); mlx-vlm's array mask for several rows."""
            if self.left_padding.shape[0] == 1 and not kwargs:
                return create_attention_mask(N, self._idx, return_array)
            return super().make_mask(N, return_array=return_array, **kwargs)

        def size(self) -> int:
            return self._idx

        @property
        def nbytes(self) -> int:
            if self.keys is None:
                return 0
            return sum(a.nbytes for a in (*self.keys, *self.values))

    _BATCH = BatchQuantizedKV
    return _BATCH


def install() -> None:
    """mlx-lm's QuantizedKVCache made batchable: BatchGenerator merges a prompt batch's
    caches by the first one's `merge`. Idempotent."""
    if getattr(QuantizedKVCache, "mlxd_batch", False):
        return
    QuantizedKVCache.merge = classmethod(lambda cls, caches: _batch_class().merge(caches))
    QuantizedKVCache.size = lambda self: self.offset
    QuantizedKVCache.mlxd_batch = True
