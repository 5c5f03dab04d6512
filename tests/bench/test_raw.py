"""bench/gpu.py `as_shipped`: raw mlx-lm's calls in a bench process that imported mlxd's
worker code run on mlx-lm's caches and attention as they ship (on CUDA
worker/loop/cuda_attention.py changes both class- and module-wide), and mlxd's are back
after the call, also when it fails."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from bench.gpu import as_shipped
from worker.loop import cuda_attention


def test_raw_calls_see_mlx_lm_as_it_ships_and_mlxd_is_back_after(monkeypatch):
    fused = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(cuda_attention, "_FUSED", fused)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", cuda_attention.attention)
    for cls in (KVCache, BatchKVCache):
        monkeypatch.setattr(cls, "step", cls.__dict__["step"])  # (restored after the test)
    cuda_attention.grow_by_decode_steps()
    growth = KVCache.__dict__["step"]
    with pytest.raises(RuntimeError):
        with as_shipped():
            assert KVCache.__dict__["step"] == BatchKVCache.__dict__["step"] == 256
            assert mx.fast.scaled_dot_product_attention is fused
            cache = KVCache()
            cache.update_and_fetch(mx.zeros((1, 2, 300, 8)), mx.zeros((1, 2, 300, 8)))
            assert cache.keys.shape[2] == 512
            raise RuntimeError("a raw call that fails")
    assert KVCache.__dict__["step"] is growth and isinstance(growth, cuda_attention.Growth)
    assert mx.fast.scaled_dot_product_attention is cuda_attention.attention
