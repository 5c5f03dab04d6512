"""The dequantizing attention (worker/kvcache/attention.py) on the CPU, where MLX has the
quantized path: `mx.quantized_matmul` made to fail as MLX 0.32.4's CUDA backend fails it,
the load check chooses the fallback instead of refusing --kv-bits, and the batch gives the
quantized path's tokens at temperature 0 (float32 model); where the fallback fails too,
--kv-bits is refused as before."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.worker.batchrun import make_batch, run_all
from tests.worker.test_worker_kv_quant import (PROMPTS, gen, kvq,  # noqa: F401 (a fixture)
                                                tokens, worker_args)
from worker.errors import LoadError
from worker.kvcache import attention
from worker.kvcache.quantized import KVFormat
from worker.loading.startup import make_batch as startup_batch


def _texts(engine, fmt):
    preps = {n: engine.prepare(gen(n, max_tokens=16)) for n in PROMPTS}
    return {n: tokens(o) for n, o in run_all(make_batch(engine, kv_format=fmt),
                                             preps).items()}


@pytest.mark.parametrize("bits", [8, 4])
def test_without_the_kernel_the_fallback_loads_and_gives_the_quantized_tokens(
        kvq, tmp_path, monkeypatch, bits):
    engine, path = kvq
    fmt = KVFormat.of(bits, 32)
    fmt.check(engine.model)
    assert not attention.dequantizes(bits, 32)
    quantized = _texts(engine, fmt)
    with monkeypatch.context() as m:
        m.setattr(attention, "_DEQUANTIZED", set())
        m.setattr(mx, "quantized_matmul", _missing)
        batch = startup_batch(engine, worker_args(tmp_path, "--kv-bits", str(bits),
                                                  "--kv-group-size", "32"), path)
        assert attention.dequantizes(bits, 32) and batch.kv_format == fmt
        # (quantized_matmul still fails: these tokens come through the fallback)
        assert _texts(engine, fmt) == quantized


def _missing(*args, **kwargs):
    raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x9x32x4")


def test_where_the_fallback_fails_too_kv_bits_is_refused(kvq, tmp_path, monkeypatch):
    engine, path = kvq
    monkeypatch.setattr(attention, "_DEQUANTIZED", set())
    monkeypatch.setattr(mx, "quantized_matmul", _missing)
    monkeypatch.setattr(mx, "dequantize", _missing)
    with pytest.raises(LoadError, match=r"cannot read a quantized KV cache on this device "
                                        r"\(\[quantized_matmul\] No implementation"):
        startup_batch(engine, worker_args(tmp_path, "--kv-bits", "8", "--kv-group-size",
                                          "32"), path)
    assert not attention.dequantizes(8, 32)
