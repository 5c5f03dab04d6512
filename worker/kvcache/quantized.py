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
model's cache are quantized (its attention layers; a recurrent layer's state and a
sliding window's rotating cache stay at full precision: each holds a bounded amount, so
a long context's KV is the global layers', Gemma 3's one layer in six), checked once at
load so that a model whose cache or attention cannot hold quantized keys is a load
error, never silently full precision.

4 bits are stored rotated (`KVFormat.rotate`, QuaRot-style): keys after RoPE and values are
multiplied by a fixed orthonormal matrix (random signs and a Hadamard transform) before
they are quantized, and the attention (worker/kvcache/attention.py) rotates the queries
alike, so q.k is unchanged, and its output back. The rotation spreads the few outlier
channels whose range ruins 4-bit groups over every channel: on SmolLM2-135M it takes 4-bit
perplexity from +41 % to about +11 % of full precision (docs/benchmarks.md; still over
the 5 % the issue asks). A snapshot names the rotation in its format tag ("q4g64r"), so it
is never read unrotated.

`--quantized-kv-start N` (as mlx-lm's generate has it) keeps short sequences at full
precision: a sequence starts with mlx-lm's plain cache and its batch converts once one of
its rows holds more than N tokens (`pass_start`, after each step). A batch is one array per
layer for every row, so a row cannot stay plain while a neighbour is quantized: the batch
converts as a whole, and a plain cache that joins a quantized batch (a new prompt, a
prefix from the cache) is quantized as it joins (`_merge_caches`, `_extend_cache` of
mlx-lm's generator, wrapped). A state stored from the batch is in the format it had then
(mlx-lm's KVCache or QuantizedKVCache), and the start is part of the format's tag, so a
snapshot is resumed only by a worker of the same format and start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import (BatchKVCache, CacheList, ChunkedKVCache, KVCache,
                                 QuantizedKVCache, create_attention_mask, make_prompt_cache)

from worker.kvcache import attention

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)   # what mx.quantize accepts


class FormatError(ValueError):
    """A model and a KV format that cannot go together (a load error)."""


@dataclass(frozen=True)
class KVFormat:
    """How attention keys and values are stored: `bits` None is full precision."""
    bits: Optional[int] = None
    group_size: int = 64
    start: int = 0   # --quantized-kv-start: tokens a sequence holds at full precision
    rotate: bool = False   # keys and values stored rotated (worker/kvcache/attention.py)

    @classmethod
    def of(cls, bits: Optional[int], group_size: int = 64, start: int = 0) -> "KVFormat":
        """The format of --kv-bits (None or 0: full precision): 4 bits rotated, since
        4-bit keys lose to their outlier channels what a rotation spreads out
        (docs/benchmarks.md); 8 bits as they are (within 1 % already)."""
        return cls(bits or None, group_size, start if bits else 0, rotate=bits == 4)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def tag(self) -> str:
        """The format in a snapshot's identity: "" for full precision (identities of
        full-precision snapshots are what they always were), else "q8g64" (rotated:
        "q4g64r"; with a start: "q8g64s1024")."""
        if not self.quantized:
            return ""
        return (f"q{self.bits}g{self.group_size}" + ("r" if self.rotate else "")
                + (f"s{self.start}" if self.start else ""))

    @property
    def from_the_first(self) -> "KVFormat":
        """This format quantized from the first token (what a long sequence comes to)."""
        return KVFormat(self.bits, self.group_size, rotate=self.rotate)

    def make(self, model, max_kv_size: Optional[int] = None) -> list:
        """A fresh cache for one sequence: the model's own, its attention layers
        quantized (with a start: plain, until its batch passes the start)."""
        cache = make_prompt_cache(model, max_kv_size)
        if not self.quantized:
            return cache
        install()
        attention.set_rotation(self.bits, self.group_size, self.rotate)
        return self.convert(cache) if not self.start else cache

    def pass_start(self, gen) -> None:
        """After a step of mlx-lm's BatchGenerator `gen`: once a row of its prompt or
        generation batch holds more than `start` tokens, both batches are quantized. (A
        row decoding alone on plain views of its caches is put back on the batch caches
        first, by the batch: worker/loop/batch.py.)"""
        if not self.quantized or not self.start:
            return
        batches = [b.prompt_cache for b in (gen._prompt_batch, gen._generation_batch)
                   if b.prompt_cache]
        # One attention layer per batch tells its rows' lengths (every layer of a batch
        # holds the same ones): a read per batch, not one per layer, on every step.
        firsts = (next((c for c in cache if type(c) is BatchKVCache and c.keys is not None),
                       None) for cache in batches)
        plain = [c for c in firsts if c is not None]
        if not plain or max(int(mx.max(c.offset).item()) for c in plain) <= self.start:
            return
        for cache in batches:
            cache[:] = [self.quantize_batch(c) for c in cache]

    def quantize_batch(self, c):
        """mlx-lm's BatchKVCache as the batched quantized cache, row for row (its left
        padding and lengths kept); anything else as it is."""
        if type(c) is not BatchKVCache:
            return c
        q = _batch_class()(c.left_padding.tolist(), group_size=self.group_size,
                           bits=self.bits)
        q.left_padding, q.offset = c.left_padding, c.offset
        q._right_padding = getattr(c, "_right_padding", None)
        if c.keys is not None and c._idx > 0:
            q.keys = attention.quantize(c.keys[..., : c._idx, :], self.group_size, self.bits)
            q.values = attention.quantize(c.values[..., : c._idx, :], self.group_size,
                                          self.bits)
            q._idx = c._idx
        return q

    def convert(self, cache: list) -> list:
        return [self._layer(c) for c in cache]

    def _layer(self, c):
        if isinstance(c, CacheList):
            return CacheList(*(self._layer(x) for x in c.caches))
        if isinstance(c, ChunkedKVCache):
            raise FormatError(f"--kv-bits: this model's {type(c).__name__} layers (chunked "
                              "attention) cannot hold a quantized KV cache yet; leave "
                              "--kv-bits unset")
        if type(c) is KVCache:
            return to_quantized(c, self.group_size, self.bits)
        # A sliding window's rotating cache (Gemma 3 and 4, gpt-oss: every layer but the
        # global ones) stays at full precision, as a recurrent layer's state does: it
        # holds its window at most, so a long context's KV is the global layers'.
        return c

    def check(self, model, max_kv_size: Optional[int] = None, model_type: str = "") -> None:
        """Raise FormatError unless `model` can run on this format: valid bits and group
        size, a cache whose attention layers can be quantized, an attention that reads
        them (a forward pass: mlx-lm's quantized attention, or where this device has no
        kernel for it, worker/kvcache/attention.py's dequantizing one), a head dimension
        the group size divides."""
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
        if self.rotate:
            try:
                mx.eval([attention.rotate(mx.zeros((1, d))) for d in dims])
            except Exception:
                raise FormatError(f"--kv-bits {self.bits}: its keys and values are rotated "
                                  "by a Hadamard transform, which MLX has for no head dimension "
                                  f"of {', '.join(map(str, sorted(dims)))}; use --kv-bits 8 or "
                                  "leave --kv-bits unset") from None
        if not any(isinstance(c, QuantizedKVCache)
                   for c in _flat(self.from_the_first.make(model, max_kv_size))):
            raise FormatError(f"--kv-bits: this model ({model_type or 'its family'}) has no "
                              "attention KV cache to quantize (recurrent layers and rotating "
                              "ones, a sliding window or --max-kv-size, stay at full "
                              "precision); leave --kv-bits unset")

        def probe():  # (a prefill of 8 tokens, then a decode step, as the batch runs)
            cache = self.from_the_first.make(model, max_kv_size)
            for n in (8, 1):
                mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache=cache),
                        [c.state for c in cache])
        try:
            attention.choose(self.bits, self.group_size, probe)
        except Exception as e:
            raise FormatError(f"--kv-bits: {model_type or 'this model family'}'s attention "
                              f"cannot read a quantized KV cache on this device "
                              f"({attention.first_line(e)})"
                              "; leave --kv-bits unset") from None


def to_quantized(c: KVCache, group_size: int, bits: int) -> QuantizedKVCache:
    """mlx-lm's plain cache as its quantized one (KVCache.to_quantized, rotated where the
    format rotates)."""
    q = QuantizedKVCache(group_size=group_size, bits=bits)
    if c.keys is not None:
        q.offset = c.offset
        q.keys = attention.quantize(c.keys[..., : c.offset, :], group_size, bits)
        q.values = attention.quantize(c.values[..., : c.offset, :], group_size, bits)
    return q


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

    base = _vlm_cache().BatchQuantizedKVCache

    class BatchQuantizedKV(base):
        update_and_fetch = _rotating(base.update_and_fetch)

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


def _rotating(update_and_fetch):
    """A quantized cache's update_and_fetch that stores new keys and values rotated where
    its format rotates (the attention rotates the queries alike)."""
    def rotating(self, keys, values):
        if attention.rotates(self.bits, self.group_size):
            keys, values = attention.rotate(keys), attention.rotate(values)
        return update_and_fetch(self, keys, values)
    return rotating


def install() -> None:
    """mlx-lm's QuantizedKVCache made batchable: BatchGenerator merges a prompt batch's
    caches by the first one's `merge`; and plain caches that meet quantized ones in its
    merge or extend (--quantized-kv-start) quantized to match. Idempotent."""
    if getattr(QuantizedKVCache, "mlxd_batch", False):
        return
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # (mlx_lm.generate: a function)
    QuantizedKVCache.merge = classmethod(lambda cls, caches: _batch_class().merge(caches))
    QuantizedKVCache.size = lambda self: self.offset
    QuantizedKVCache.update_and_fetch = _rotating(QuantizedKVCache.update_and_fetch)
    QuantizedKVCache.mlxd_batch = True

    merge, extend = generate._merge_caches, generate._extend_cache

    def _merge_caches(caches):
        for i in range(len(caches[0]) if caches else 0):
            q = next((c[i] for c in caches if type(c[i]) is QuantizedKVCache), None)
            if q is not None:
                for c in caches:
                    if type(c[i]) is KVCache:
                        c[i] = to_quantized(c[i], q.group_size, q.bits)
        return merge(caches)

    def _extend_cache(cache_a, cache_b):
        for a, b in ((cache_a, cache_b), (cache_b, cache_a)):
            for i in range(min(len(a or ()), len(b or ()))):
                if type(a[i]) is BatchKVCache and isinstance(b[i], _batch_class()):
                    a[i] = KVFormat(b[i].bits, b[i].group_size).quantize_batch(a[i])
        return extend(cache_a, cache_b)

    generate._merge_caches, generate._extend_cache = _merge_caches, _extend_cache
