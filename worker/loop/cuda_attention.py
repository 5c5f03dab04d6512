"""On CUDA, attention whose cuDNN graph would be built for a shape seldom seen twice runs
without one: a prompt pass after cached keys by MLX's plain ops, decoding by its vector kernel.

MLX's CUDA backend runs a prompt pass's attention (more than one query) through cuDNN's
fused attention, whose graph it builds for each new set of shapes and strides
(mlx/backend/cuda/scaled_dot_product_attention.cpp `build_sdpa_cache_key`: the queries'
and the keys' shapes, the key count among them). A cold prompt's passes repeat their
shapes (their chunks are padded to buckets: worker/loop/mlx_lm_patches.py), but a pass
after cached keys (the next turn of a conversation, a prompt that shares a system prompt
with an earlier one) attends to as many keys as the cache held plus its own: a count
seldom seen twice, so nearly every warm prompt paid a new graph. Measured on a lent H200
(the 0.5B shape, bfloat16, the whole model's pass of 128 tokens after a cache of ~2,000):
62 ms at a key count new each time against 8-13 ms at one seen before; with cuDNN's
attention switched off for the process (MLX_CUDA_USE_CUDNN_SDPA=0, so MLX's own
fallback of matmuls and a softmax), 17-20 ms new and 13.5 seen
(bench/attention_shapes.py; docs/benchmarks.md, session 21). Switching it off for the
process would give up cuDNN where its shapes do repeat (a cold prompt's passes), and the
setting is read once per process, so the choice is made per call instead: MLX's
fallback, written out here as MLX writes it (mlx/fast.cpp), for a prompt pass after
cached keys (`MIN_QUERIES`) whose key count is not a bucket's multiple (a cold prompt's
later chunks are: those keep cuDNN) and whose scores stay small (`SCORES`: a long pass
is worth a build, and its scores would be large). Decoding (one query) and a draft's
verification keep MLX's own choice.

Decoding is steered by the caches' allocation instead: MLX decodes (one query, no mask
array) by cuDNN exactly when the keys are a slice of a buffer whose length is a multiple
of 256, mlx-lm's cache step (`use_cudnn_for_decoding`, "number is from mlx-lm"), and else
by its own vector kernel, which needs no graph. cuDNN's decode graph is keyed by the
buffer's length, so a stream builds one every 256 tokens of context. Which is faster
depends on how much a layer's keys hold. On a lent H200, plain caches decoding 200 tokens
after a context (geometric means of alternating rounds in one process: bench/
attention_shapes.py `--decode`; docs/benchmarks.md, sessions 22 and 24), the vector
kernel ran 1.28, 1.13 and 1.04 × cuDNN's rate on the 0.5B shape (2 KV heads of 64) after
1,000, 4,000 and 16,000 tokens; on 7B (4 KV heads of 128) about even up to 8,000 (0.90
to 1.10 by run), then behind: 0.74, 0.93 and 0.77 after 16,000, 0.68 and 0.63 after
32,000. So on CUDA the worker's caches grow `DECODE_STEP` tokens at a time (257, prime
to 256: the vector kernel) while a layer's keys hold fewer than `CUDNN_DECODE` values
(KV heads × head size × tokens: 8,192 tokens of 7B, 32,768 of 0.5B), and past that to
multiples of 256 (cuDNN), as mlx-lm's own caches do (`Growth`). (A sliding window's
full buffer is its window, not a step's multiple: its decode keeps MLX's choice; a
batch's decode has a mask array and takes the vector kernel either way.)

Only where mlx_lm_patches.BUCKET is set (CUDA; tests set it to run this on the CPU),
read at each call. `install()` wraps `mx.fast.scaled_dot_product_attention`, which
mlx-lm's and mlx-vlm's models look up at each call, and sets the step of mlx-lm's caches
(worker/loop/batch.py installs it with mlx-lm's patches).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.loop import mlx_lm_patches

# More queries than a verification's (worker/speculative: a draft of up to 8 tokens and the
# token before it). A verify step keeps MLX's choice: its price, measured on an H200 (1.86 ×
# a one-token step, session 10), shows no build, and the fallback's seven kernels for one
# would add launches to every step that drafts.
MIN_QUERIES = 16
# Scores (batch × query heads × queries × keys) up to which a pass after cached keys is
# computed by plain ops: 2^27 is 128 queries against 64K keys on 16 heads, 256 MiB at
# bfloat16; beyond it the pass itself outweighs a graph's build.
SCORES = 1 << 27
# The tokens a cache grows by on CUDA: not a multiple of 256, so decoding takes MLX's
# vector kernel, not a cuDNN graph per 256 tokens (the module's doc).
DECODE_STEP = 257
# A layer's key values (KV heads × head size × tokens) from which a cache grows to
# multiples of 256 (cuDNN's decode): the 7B shape's 8,192 tokens, where the two were
# even (vector slower after 16,000 in three runs, 0.63-0.68 × after 32,000), the 0.5B's
# 32,768 (the vector kernel at least even up to 16,000).
CUDNN_DECODE = 1 << 22

_FUSED = None  # MLX's own, once install() wrapped it


def install() -> None:
    """Wraps MLX's attention and sets the caches' step where BUCKET is set (elsewhere a
    call through Python per layer and token for nothing: tests put `attention` in place
    themselves). Idempotent."""
    global _FUSED
    if _FUSED is None:
        _FUSED = mx.fast.scaled_dot_product_attention
        if mlx_lm_patches.BUCKET:
            mx.fast.scaled_dot_product_attention = attention
            grow_by_decode_steps()


def grow_by_decode_steps() -> None:
    """mlx-lm's caches (plain ones: a lone sequence's views, a draft model's; and the
    batch's) grow as `Growth` says, through the class attribute `step` their growth reads."""
    for cls in (KVCache, BatchKVCache):
        cls.step = Growth()


class Growth:
    """A cache's `step` as its growth reads it. mlx-lm's KVCache and BatchKVCache grow a
    buffer that cannot take `n` more tokens to: the tokens held (`prev`) where `prev` is
    not a multiple of the step, else the whole old buffer (`have`), plus `ceil(n / step)`
    steps. This answers DECODE_STEP while a layer's keys are short of CUDNN_DECODE, then a
    step whose growth lands on a multiple of 256 for any `n` where it can: a full buffer
    (a decode step's growth) the rest to the next multiple; a buffer on a multiple, 256;
    a buffer off one holding a multiple of 256 tokens (a prompt chunk's growth after a
    short prompt's buffer), 256 × m with m the least not dividing prev / 256, so the
    buffer is cut to `prev` and grown by whole multiples. What is left (tokens held off
    a multiple in a buffer off one: a chunk after a warm start) gets the rest to the next
    multiple, and the next decode growth lands on one. Read on the class (a step for
    counting: Batch.holds), DECODE_STEP. A non-data descriptor: a cache's own `step`
    (set on the instance) still wins."""

    def __get__(self, cache, owner=None) -> int:
        keys = None if cache is None else cache.keys
        if keys is None:
            return DECODE_STEP
        _, heads, have, dim = keys.shape
        if heads * dim * have < CUDNN_DECODE:
            return DECODE_STEP
        prev = getattr(cache, "_idx", None)  # (BatchKVCache's; a plain cache's is `offset`)
        prev = cache.offset if prev is None else prev
        if prev == have or have % 256 == 0 or prev % 256:
            return (-have) % 256 or 256
        m = 2
        while (prev // 256) % m == 0:
            m += 1
        return 256 * m


def attention(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
    """mx.fast.scaled_dot_product_attention, by `plain` for what the module's doc says."""
    if after_cached_keys(q, k, mask, sinks, kwargs):
        return plain(q, k, v, scale, mask)
    return _FUSED(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)


def after_cached_keys(q, k, mask, sinks, kwargs) -> bool:
    """A pass of more than MIN_QUERIES queries after cached keys, at a key count not a
    bucket's multiple, with small scores (`SCORES`), no sinks (gpt-oss: cuDNN's) and a
    mask the fallback reads (none, "causal", an array)."""
    bucket = mlx_lm_patches.BUCKET
    queries, keys = q.shape[2], k.shape[2]
    if not bucket or not MIN_QUERIES < queries < keys or keys % bucket == 0:
        return False
    if sinks is not None or kwargs.get("force_fused") or (isinstance(mask, str)
                                                          and mask != "causal"):
        return False
    return q.shape[0] * q.shape[1] * queries * keys <= SCORES


def plain(q, k, v, scale: float, mask):
    """MLX's fallback (mlx/fast.cpp `scaled_dot_product_attention`), sinks aside:
    grouped heads unflattened, a causal mask aligned to the last keys, a boolean mask as
    the dtype's lowest value, a precise softmax."""
    dtype = mx.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    heads, kv_heads = q.shape[1], k.shape[1]
    repeats = heads // kv_heads
    q = q * mx.array(scale, dtype)
    if repeats > 1:
        q = mx.unflatten(q, 1, (kv_heads, repeats))
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if isinstance(mask, str):  # "causal"
        kl, ql = k.shape[-2], q.shape[-2]
        mask = mx.arange(kl - ql, kl)[:, None] >= mx.arange(kl)[None]
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3) if mask.shape[-3] == 1 \
                else mx.unflatten(mask, -3, (kv_heads, repeats))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return mx.flatten(out, 1, 2) if repeats > 1 else out
