"""4-bit KV stored rotated (worker/kvcache/quantized.py KVFormat.rotate, the rotation in
worker/kvcache/attention.py): the attention of rotated keys and values is the attention of
the keys and values (the rotation is orthonormal) and loses less to 4 bits where a few
channels carry outliers; every way a plain cache becomes a quantized one stores the same
rotated keys as quantizing them on arrival; --kv-bits 4 is the rotated format and names
it in the snapshot identity. (Batch equals solo, prefix reuse and snapshot resume with it:
test_worker_kv_quant's 4-bit cases, whose Q4 is this format.)"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from worker.kvcache import attention
from worker.kvcache.quantized import KVFormat, _batch_class, to_quantized

R4, PLAIN4 = KVFormat.of(4, 32), KVFormat(4, 32)


@pytest.fixture(autouse=True)
def _restore_rotation(monkeypatch):
    monkeypatch.setattr(attention, "_ROTATED", set())


def _qkv(outliers: bool):
    mx.random.seed(3)
    q = mx.random.normal((1, 4, 5, 64))
    k, v = mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64))
    if outliers:  # (as real keys after RoPE: a channel far larger than the rest)
        k = k * mx.where(mx.arange(64) == 3, 20.0, 1.0)
    return q, k, v


class _Model:
    """What KVFormat.make reads of a model: its caches (one attention layer)."""

    def make_cache(self):
        return [KVCache()]


def _layer(fmt) -> QuantizedKVCache:
    """A cache of `fmt` (which sets the process's rotation for its bits, as a worker's)."""
    return fmt.make(_Model())[0]


def _error(fmt, outliers: bool) -> float:
    """The mean difference of the attention through a cache of `fmt` from the attention
    of the keys and values themselves."""
    q, k, v = _qkv(outliers)
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    cache = _layer(fmt)
    keys, values = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.125, mask=None)
    return mx.abs(out - full).mean().item()


def test_the_rotation_keeps_the_attention_and_spreads_the_outliers():
    # Lossless in the math: 8 bits rotated are about as close as 8 bits plain (queries
    # not rotated alike, or the output not rotated back, would be far off).
    assert _error(KVFormat(8, 32, rotate=True), False) < 0.005
    assert _error(KVFormat(8, 32), False) < 0.005
    # 4 bits: the outlier channel costs the plain format more than the rotated one.
    assert _error(R4, True) < 0.8 * _error(PLAIN4, True)


def test_a_plain_cache_converts_to_the_keys_quantized_on_arrival():
    """--quantized-kv-start converts plain caches (one sequence's, a batch's): they hold
    what a cache of the rotated format holds after the same keys, as the batch's own
    quantized cache does."""
    _, k, v = _qkv(True)
    arrived = _layer(R4)
    arrived.update_and_fetch(k, v)
    plain = KVCache()
    plain.update_and_fetch(k, v)
    converted = to_quantized(plain, 32, 4)
    for a, b in zip((*arrived.keys, *arrived.values), (*converted.keys, *converted.values)):
        assert mx.array_equal(a[..., :40, :], b)
    batch = BatchKVCache([0])
    batch.update_and_fetch(k, v)
    quantized = R4.quantize_batch(batch)
    batched = _batch_class()([0], group_size=32, bits=4)
    batched.update_and_fetch(k, v)
    for a, b, c in zip(converted.keys, quantized.keys, batched.keys):
        assert mx.array_equal(a, b) and mx.array_equal(a, c[..., :40, :])


def test_kv_bits_4_is_the_rotated_format_and_its_snapshots_say_so():
    assert KVFormat.of(4, 64).rotate and not KVFormat.of(8, 64).rotate
    assert KVFormat.of(4, 32, 100).tag == "q4g32rs100" and KVFormat.of(4, 32).tag == "q4g32r"
    assert PLAIN4.tag == "q4g32" and KVFormat.of(8, 32).tag == "q8g32"
    assert KVFormat.of(0, 64) == KVFormat() and KVFormat.of(None, 64, 5).tag == ""
