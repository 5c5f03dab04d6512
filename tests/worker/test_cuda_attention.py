"""worker/loop/cuda_attention.py: on CUDA a prompt pass after cached keys attends by MLX's
own fallback ops rather than cuDNN (whose graph is built per key count). Run on the CPU
with mlx_lm_patches.BUCKET set as on CUDA and the wrapper put in place: its output equals
MLX's attention for every mask and head grouping a model passes, it is taken only for the
passes it is for, and a warm prompt served through it says what it says without it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from protocol.messages import pack_ids
from tests.generates import generate
from tests.worker.batchrun import make_batch, steps
from tests.worker.test_worker_batching import tokens
from worker.loop import cuda_attention, mlx_lm_patches


@pytest.fixture
def on_cuda(monkeypatch):
    """BUCKET as on CUDA and the wrapper in place (install() leaves it out elsewhere);
    returns the calls that took the plain path."""
    cuda_attention.install()
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 16)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", cuda_attention.attention)
    calls = []
    plain = cuda_attention.plain

    def counted(q, k, v, scale, mask):
        calls.append((q.shape[2], k.shape[2]))
        return plain(q, k, v, scale, mask)

    monkeypatch.setattr(cuda_attention, "plain", counted)
    return calls


def qkv(repeats: int, queries: int = 5, keys: int = 23, batch: int = 2, kv_heads: int = 2):
    mx.random.seed(repeats * 100 + queries)
    return (mx.random.normal((batch, kv_heads * repeats, queries, 16)),
            mx.random.normal((batch, kv_heads, keys, 16)),
            mx.random.normal((batch, kv_heads, keys, 16)))


@pytest.mark.parametrize("repeats", [1, 2])
@pytest.mark.parametrize("mask", [None, "causal", "bool rows", "bool 2-D", "additive heads"])
def test_the_plain_path_equals_mlxs_attention(repeats, mask):
    q, k, v = qkv(repeats)
    b, h, ql, kl = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    m = {"bool rows": lambda: mx.random.uniform(shape=(b, 1, ql, kl)) > 0.3,
         "bool 2-D": lambda: mx.random.uniform(shape=(ql, kl)) > 0.3,
         "additive heads": lambda: mx.random.normal((b, h, ql, kl))}.get(mask, lambda: mask)()
    cuda_attention.install()
    want = cuda_attention._FUSED(q, k, v, scale=0.25, mask=m)
    got = cuda_attention.plain(q, k, v, 0.25, m)
    assert got.shape == want.shape == q.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_only_a_pass_after_cached_keys_takes_the_plain_path(on_cuda):
    sdpa = mx.fast.scaled_dot_product_attention
    for queries, keys, kw in ((20, 53, {}), (20, 53, {"mask": "causal"}),  # plain
                              (1, 53, {}),   # decoding: MLX's choice
                              (9, 53, {}),   # a verification (a draft of 8): MLX's
                              (32, 32, {"mask": "causal"}),  # from nothing
                              (20, 64, {}),  # a multiple of the bucket: a cold chunk
                              (20, 53, {"sinks": mx.zeros((2,))})):
        q, k, v = qkv(1, queries, keys)
        sdpa(q, k, v, scale=0.25, **kw)
    assert on_cuda == [(20, 53), (20, 53)]
    q, k, v = qkv(1, 64, 4099)
    cuda_attention.SCORES, before = 2 * 2 * 64 * 4099 - 1, cuda_attention.SCORES
    try:
        sdpa(q, k, v, scale=0.25)  # (scores past SCORES: cuDNN's)
    finally:
        cuda_attention.SCORES = before
    assert len(on_cuda) == 2
    mlx_lm_patches.BUCKET = 0  # (the fixture's monkeypatch restores it)
    sdpa(*qkv(1), scale=0.25)
    assert len(on_cuda) == 2


def test_a_warm_prompt_through_the_plain_path_says_what_it_says_cold(engine, on_cuda,
                                                                     monkeypatch):
    # A prompt that resumes from the prefix cache (its first 150 tokens cached) attends
    # after cached keys in every layer: the plain path, each layer of its one pass; the
    # cold prompt's passes (from nothing) keep MLX's. Tokens and log-probabilities as without it.
    import random

    from worker.kvcache.prefix import PrefixCache

    rng = random.Random(11)
    ids = [rng.randrange(10, 200) for _ in range(150)]
    longer = ids + [rng.randrange(10, 200) for _ in range(30)]  # (a pass of 32 after them)

    def ask(prompt, batch):
        g = generate(rid="w", prompt_ids=pack_ids(prompt), max_tokens=8, temperature=0.0,
                     logprobs=True)
        return [o for o in steps(engine, engine.prepare(g), batch) if o is not None]

    batch = make_batch(engine, prefix=PrefixCache(1 << 26))
    ask(ids, batch)
    assert on_cuda == []  # (cold: every pass from nothing, or one query)
    warm = ask(longer, batch)
    layers = len(engine.model.layers)
    assert len(on_cuda) == layers and all(q > 1 and k > q for q, k in on_cuda)
    monkeypatch.setattr(mlx_lm_patches, "BUCKET", 0)
    cold = ask(longer, make_batch(engine))
    assert len(warm) == 8 and tokens(warm) == tokens(cold)
    assert all(abs(a[3].logprob - b[3].logprob) < 1e-4 for a, b in zip(warm, cold))


def test_on_cuda_decoding_takes_the_vector_kernel_until_the_keys_are_long(engine, monkeypatch):
    # MLX decodes by cuDNN (a graph per buffer length) exactly when the keys are a slice
    # of a buffer whose length is a multiple of 256; on CUDA the caches grow by
    # DECODE_STEP (the vector kernel) until a layer's keys hold CUDNN_DECODE values, then
    # to multiples of 256 (cuDNN's, faster on long keys). Every decode step's buffer, a
    # lone stream's (plain views) and two streams' (the batch cache), past growths of
    # each: without the policy some multiples of 256 early; with it none below the
    # threshold and only multiples past it; the same tokens either way.
    import random

    from mlx_lm.models.cache import BatchKVCache, KVCache

    from tests.worker.batchrun import run_all

    buffers = []  # (buffer length, KV heads × head size) at each decode step
    for cls in (KVCache, BatchKVCache):
        own = cls.update_and_fetch

        def spy(self, keys, values, _own=own):
            out = _own(self, keys, values)
            if keys.shape[2] == 1:
                buffers.append((self.keys.shape[2], keys.shape[1] * keys.shape[3]))
            return out

        monkeypatch.setattr(cls, "update_and_fetch", spy)
        monkeypatch.setattr(cls, "step", cls.__dict__["step"])  # (restored after the test)
    rng = random.Random(5)
    prompts = {name: [rng.randrange(10, 200) for _ in range(n)]
               for name, n in (("a", 200), ("b", 230))}

    def run(names):
        preps = {n: engine.prepare(generate(rid=n, prompt_ids=pack_ids(prompts[n]),
                                            max_tokens=400, temperature=0.0))
                 for n in names}
        out = run_all(make_batch(engine), preps)
        return {n: [o[0] for o in outs] for n, outs in out.items()}

    plain = [run(["a"]), run(["a", "b"])]
    assert any(n % 256 == 0 and n < 300 for n, _ in buffers)  # (mlx-lm's step: cuDNN's)
    width = buffers[0][1]
    buffers.clear()
    monkeypatch.setattr(cuda_attention, "CUDNN_DECODE", width * 300)
    cuda_attention.grow_by_decode_steps()
    step = cuda_attention.DECODE_STEP
    assert KVCache.step == BatchKVCache.step == step  # (read on the class: for counting)
    stepped = [run(["a"]), run(["a", "b"])]
    short = {n for n, _ in buffers if n < 300}
    long = {n for n, _ in buffers if n >= 300}
    assert short == {step} and 2 * step in long  # (grown by DECODE_STEP while short)
    assert all(n == 2 * step or n % 256 == 0 for n in long) and {768} <= long
    assert stepped == plain and len(plain[1]["b"]) == 400


def test_a_cache_grows_to_multiples_of_256_from_long_keys_on(monkeypatch):
    # Growth's step for a full buffer at each length: DECODE_STEP below the threshold,
    # then the step to the next multiple of 256 (a buffer on a multiple grows by 256);
    # a prompt's chunks land on multiples too; a cache's own step wins.
    from mlx_lm.models.cache import KVCache

    monkeypatch.setattr(KVCache, "step", cuda_attention.Growth())
    monkeypatch.setattr(cuda_attention, "CUDNN_DECODE", 2 * 8 * 600)
    cache = KVCache()
    lengths = []
    for _ in range(1800):
        cache.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 4)))
        if not lengths or lengths[-1] != cache.keys.shape[2]:
            lengths.append(cache.keys.shape[2])
    assert lengths == [257, 514, 771, 1024, 1280, 1536, 1792, 2048]
    assert cache.offset == 1800 and cache.values.shape[2] == 2048
    prompt = KVCache()
    prompt.update_and_fetch(mx.zeros((1, 2, 700, 8)), mx.zeros((1, 2, 700, 4)))
    assert prompt.keys.shape[2] == 771  # (a chunk from nothing: DECODE_STEP's multiple)
    for _ in range(72):
        prompt.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 4)))
    assert prompt.keys.shape[2] == 1024  # (then back on 256's multiples)
    chunked = KVCache()  # (a prompt in chunks of 2,048 past the threshold)
    for n in (2048, 2048, 2048, 700):
        chunked.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 4)))
        lengths.append(chunked.keys.shape[2])
    assert lengths[-4:] == [2056, 2048 + 3 * 768, 6400, 7168]  # (cut to 2,048, then 256s)
    own = KVCache()
    own.step = 64
    own.update_and_fetch(mx.zeros((1, 2, 700, 8)), mx.zeros((1, 2, 700, 4)))
    assert own.keys.shape[2] == 704
