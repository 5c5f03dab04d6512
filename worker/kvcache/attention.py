"""The attention that reads a quantized KV cache (--kv-bits: worker/kvcache/quantized.py),
by one of two paths, chosen at load by what the device can run rather than by its name.

mlx-lm's (`models/base.py`: `quantized_scaled_dot_product_attention`) multiplies the
queries by the packed keys, and the scores by the packed values, with
`mx.quantized_matmul`: on Metal and the CPU that is the fast path, and nothing is ever
held at full precision. MLX 0.32.4's CUDA backend has no `quantized_matmul` kernel for
attention's shapes ("No implementation for problem shape": a few queries against a key
buffer sliced from its allocation), so where that path fails the cached keys and values
are dequantized (`mx.dequantize`) for each layer's attention and
`mx.fast.scaled_dot_product_attention` reads them. The cache at rest stays quantized (the
KV budget, bytes per token, the prefix cache and snapshots are the same), and one layer's
keys and values exist at full precision during its attention only (a step's transient
memory, which the batch's StepMemory measures at load, after this choice).

What CUDA's quantized_matmul does take (an H200, 8 bits in groups of 64 and 32, 1 to 2,304
keys, 1 and 8 queries): any contiguous packed array, and no slice of a larger allocation
unless the slice is all of it. A third path, each layer's packed slice copied contiguous
for mlx-lm's attention, was built and measured there and dropped: a 7B shape's single
stream after a 2,049-token prompt decoded at 3.6 tok/s, against 81 dequantized and 159 at
full precision (each step's key count a shape new to MLX's kernels, it seems).

MLX reports a missing kernel when the graph is evaluated, not when it is built, so the
choice cannot be made per call: `choose` runs a probe (a forward pass through a quantized
cache) on the quantized path and, if MLX fails it, on the dequantizing one (logged). The
choice is per (bits, group size), the arguments the attention is called with, so formats
do not share it by accident (a benchmark measures several in one process).

Either path reads rotated keys and values (4 bits: worker/kvcache/quantized.py
KVFormat.rotate): the queries are rotated alike (q.k is unchanged by an orthonormal
rotation) and the output rotated back. Whether a (bits, group size) is rotated is set by
`KVFormat.make`, once per process in a worker (it has one format); the caches read it
when keys arrive (`quantize`, `rotate`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Callable

import mlx.core as mx

log = logging.getLogger("worker.kvcache.attention")

# (bits, group size) whose attention dequantizes: the device failed quantized_matmul.
_DEQUANTIZED: set = set()
_QUANTIZED = None   # mlx-lm's own quantized attention, once install() replaced it
# (bits, group size) whose keys and values are stored rotated (KVFormat.rotate).
_ROTATED: set = set()


def install() -> None:
    """mlx-lm's quantized attention replaced by `attention` (every mlx-lm model reads it
    through `base.scaled_dot_product_attention`, which looks it up at each call).
    Idempotent."""
    global _QUANTIZED
    from mlx_lm.models import base, gemma4_text

    if _QUANTIZED is None:
        _QUANTIZED = base.quantized_scaled_dot_product_attention
        base.quantized_scaled_dot_product_attention = attention
        gemma4_text.scaled_dot_product_attention = _shared_kv(
            gemma4_text.scaled_dot_product_attention)


def _shared_kv(sdpa):
    """Gemma 4's small checkpoints' last layers attend to an earlier layer's keys and
    values with no cache of their own (`num_kv_shared_layers`): with a quantized cache
    those arrive packed, and mlx-lm's attention, told by the layer's cache (None) that
    they are not, hands them to MLX's plain attention, which refuses them. Packed keys
    read as what they are: the format is in their shapes (the packed words and the
    scales per head dimension)."""
    @functools.wraps(sdpa)
    def call(queries, keys, values, cache, scale, mask, *args, **kwargs):
        if isinstance(keys, tuple) and not hasattr(cache, "bits"):
            d = queries.shape[-1]
            return attention(queries, keys, values, scale, mask,
                             group_size=d // keys[1].shape[-1], bits=keys[0].shape[-1] * 32 // d)
        return sdpa(queries, keys, values, cache, scale, mask, *args, **kwargs)

    return call


def attention(queries, q_keys, q_values, scale: float, mask, group_size: int = 64,
              bits: int = 8):
    """mlx-lm's quantized attention, or where this device cannot run it for this format,
    the dequantized keys and values through MLX's fused attention. Of rotated keys and
    values, with the queries rotated alike and the output rotated back."""
    rotated = (bits, group_size) in _ROTATED
    if rotated:
        queries = rotate(queries)
    if (bits, group_size) not in _DEQUANTIZED:
        out = _QUANTIZED(queries, q_keys, q_values, scale, mask, group_size, bits)
    else:
        keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits)
        values = mx.dequantize(*q_values, group_size=group_size, bits=bits)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                   mask=mask)
    return unrotate(out) if rotated else out


def set_rotation(bits: int, group_size: int, on: bool) -> None:
    """Whether this format's keys and values are stored rotated: one answer per (bits,
    group size) in a process (a worker has one KV format; KVFormat.make sets it)."""
    install()
    (_ROTATED.add if on else _ROTATED.discard)((bits, group_size))


def rotates(bits: int, group_size: int) -> bool:
    return (bits, group_size) in _ROTATED


def quantize(x, group_size: int, bits: int) -> tuple:
    """Keys or values as the cache of this format stores them (rotated, if it rotates)."""
    x = rotate(x) if (bits, group_size) in _ROTATED else x
    return mx.quantize(x, group_size=group_size, bits=bits)


def dequantize(q: tuple, group_size: int, bits: int):
    """The full-precision keys or values a cache of this format stores as `q` (rotated
    back, if it rotates): `quantize`'s inverse, up to its rounding."""
    x = mx.dequantize(*q, group_size=group_size, bits=bits)
    return unrotate(x) if (bits, group_size) in _ROTATED else x


def rotate(x):
    """x (..., d) times an orthonormal matrix: random signs, then the normalized
    Hadamard transform (d = m x 2^k, m in 1, 12, 20, 28: what MLX transforms)."""
    return mx.hadamard_transform(x * _signs(x.shape[-1], x.dtype))


def unrotate(x):
    return mx.hadamard_transform(x) * _signs(x.shape[-1], x.dtype)


@functools.lru_cache(maxsize=None)
def _signs(d: int, dtype):
    """d fixed random signs, the same on every machine and MLX version (a snapshot
    written rotated is read by another worker): bits of a hash, not MLX's generator."""
    bits = hashlib.shake_256(b"mlxd kv rotation").digest((d + 7) // 8)
    return mx.array([1 - 2 * (bits[i // 8] >> (i % 8) & 1) for i in range(d)], dtype=dtype)


def dequantizes(bits: int, group_size: int) -> bool:
    """Whether this format's attention takes the dequantizing path."""
    return (bits, group_size) in _DEQUANTIZED


def choose(bits: int, group_size: int, probe: Callable[[], None]) -> str:
    """The path this format's attention takes on this device: "quantized" if `probe` (a
    forward pass through a cache of this format, evaluated) runs on mlx-lm's path, else
    "dequantized" if it runs on the fallback; if neither runs, the quantized path's
    error is raised."""
    install()
    key = (bits, group_size)
    _DEQUANTIZED.discard(key)
    try:
        probe()
        return "quantized"
    except Exception as e:
        first = e
    _DEQUANTIZED.add(key)
    try:
        probe()
    except Exception:
        _DEQUANTIZED.discard(key)
        raise first from None
    log.warning("--kv-bits %d: this device cannot run the quantized attention (%s); its "
                "keys and values are dequantized for each step's attention (the cache "
                "stays quantized)", bits, first_line(first))
    return "dequantized"


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
