"""GGUF import (worker/loading/gguf/): files written as llama.cpp writes them (tests/worker/
gguf_files.py) convert back into mlx-lm models with the original's logits and tokenizer;
what cannot be converted is a GGUFError naming why; conversions are cached by hash and
options."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.worker import gguf_files
from worker.loading import gguf
from worker.loading.gguf.families import unpermute
from worker.loading.gguf.reader import GGUFFile

F32 = gguf.Options("float32")
TOKENS = [[5, 17, 42, 99, 3, 250, 7, 600]]


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]


def write(tmp_path: Path, tiny_model: Path, vocab: int, family: str, **kw) -> tuple:
    model, config = gguf_files.random_model(family, vocab)
    path = gguf_files.write(tmp_path / f"{family}.gguf", family, model, config, tiny_model, **kw)
    return path, model


def logits(model, tokens=TOKENS) -> np.ndarray:
    import mlx.core as mx

    return np.array(model(mx.array(tokens)).astype(mx.float32))


def test_unpermute_undoes_llama_cpps_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute(gguf_files.permute(w, heads), heads), w)
    assert not np.array_equal(gguf_files.permute(w, 8), w)  # it does move rows


@pytest.mark.parametrize("family", sorted(gguf_files.FAMILIES))
def test_a_family_round_trips_to_the_same_logits(tmp_path, tiny_model, vocab, family):
    import mlx_lm

    path, original = write(tmp_path, tiny_model, vocab, family)
    out = gguf.ensure(path, tmp_path / "out", F32)
    converted, _ = mlx_lm.load(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == gguf_files.FAMILIES[family][0]
    np.testing.assert_allclose(logits(converted), logits(original), rtol=1e-4, atol=1e-4)


def test_the_tokenizer_and_template_are_the_files(tmp_path, tiny_model, vocab):
    import mlx_lm
    from transformers import AutoTokenizer

    path, _ = write(tmp_path, tiny_model, vocab, "qwen2")
    _, tok = mlx_lm.load(str(gguf.ensure(path, tmp_path / "out", F32)))
    want = AutoTokenizer.from_pretrained(str(tiny_model))
    for text in ["Hello, world!  two  spaces\nnew line", "café 日本語 😀 {\"a\": 1}",
                 "<|im_start|>user\nhi<|im_end|>", "1234567 tokens"]:
        assert tok.encode(text) == want.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert tok.eos_token_ids == {want.convert_tokens_to_ids("<|im_end|>")}


def test_quantized_files_dequantize_close_to_the_original(tmp_path, tiny_model, vocab):
    import mlx_lm

    for qtype in ("Q8_0", "Q5_1", "Q4_0"):
        path, original = write(tmp_path, tiny_model, vocab, "qwen2", qtype=qtype)
        converted, _ = mlx_lm.load(str(gguf.ensure(path, tmp_path / qtype, F32)))
        want, got = logits(original), logits(converted)
        # Quantization error, not a layout error: the same tokens win almost everywhere.
        assert np.mean(want.argmax(-1) == got.argmax(-1)) >= 0.75, qtype
        assert np.corrcoef(want.ravel(), got.ravel())[0, 1] > 0.98, qtype


def test_quantize_requantizes_to_mlx_bits(tmp_path, tiny_model, vocab):
    import mlx_lm

    path, original = write(tmp_path, tiny_model, vocab, "llama")
    out = gguf.ensure(path, tmp_path / "q8", gguf.Options("float32", "8"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    converted, _ = mlx_lm.load(str(out))
    assert np.corrcoef(logits(original).ravel(), logits(converted).ravel())[0, 1] > 0.99


def test_bfloat16_is_stored_as_bfloat16(tmp_path, tiny_model, vocab):
    import mlx.core as mx

    path, _ = write(tmp_path, tiny_model, vocab, "qwen3")
    out = gguf.ensure(path, tmp_path / "bf16", gguf.Options("bfloat16"))
    weights = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}


def test_a_conversion_is_reused_and_redone_when_stale(tmp_path, tiny_model, vocab):
    path, _ = write(tmp_path, tiny_model, vocab, "qwen2")
    calls = []
    out = gguf.ensure(path, tmp_path / "out", F32, memo_dir=tmp_path,
                      progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]      # progress reached the end
    n = len(calls)
    assert gguf.ensure(path, out, F32, memo_dir=tmp_path,
                       progress=lambda *a: calls.append(a)) == out
    assert len(calls) == n                               # found, not converted again
    marker = json.loads((out / "mlxd-gguf.json").read_text())
    assert marker["sha256"] == gguf.sha256(path) and marker["options"] == ["float32", "none"]
    (out / "mlxd-gguf.json").write_text("{}")           # e.g. an older converter's output
    gguf.ensure(path, out, F32, memo_dir=tmp_path, progress=lambda *a: calls.append(a))
    assert len(calls) > n
    assert list(tmp_path.glob(".out.*")) == []           # no temporary left behind


def test_the_cache_key_is_the_files_hash_and_the_options(tmp_path, tiny_model, vocab):
    path, _ = write(tmp_path, tiny_model, vocab, "qwen2")
    digest = gguf.sha256(path, tmp_path)
    assert gguf.sha256(path, tmp_path) == digest         # from the memo
    assert gguf.cache_dir(tmp_path, digest, F32) != gguf.cache_dir(
        tmp_path, digest, gguf.Options("float32", "4"))
    path.write_bytes(path.read_bytes() + b"\0")          # the file changed: hashed again
    assert gguf.sha256(path, tmp_path) != digest


def test_an_unknown_architecture_is_named(tmp_path, tiny_model, vocab):
    path, _ = write(tmp_path, tiny_model, vocab, "llama", arch="mamba")
    with pytest.raises(gguf.GGUFError, match="architecture 'mamba' cannot be converted"):
        gguf.ensure(path, tmp_path / "out", F32)
    assert not (tmp_path / "out").exists()


def test_an_undequantizable_tensor_type_is_named(tmp_path, tiny_model, vocab):
    import gguf as gguf_pkg

    odd = {"blk.0.odd.weight": (np.zeros(32, np.int8), gguf_pkg.GGMLQuantizationType.I8)}
    path, _ = write(tmp_path, tiny_model, vocab, "qwen2", extra_tensors=odd)
    with pytest.raises(gguf.GGUFError, match="I8"):
        gguf.ensure(path, tmp_path / "out", F32)


def test_an_unknown_tensor_is_an_error_not_dropped(tmp_path, tiny_model, vocab):
    import gguf as gguf_pkg

    odd = {"blk.0.odd.weight": (np.zeros(32, np.float32), gguf_pkg.GGMLQuantizationType.F32)}
    path, _ = write(tmp_path, tiny_model, vocab, "qwen2", extra_tensors=odd)
    with pytest.raises(gguf.GGUFError, match="blk.0.odd.weight"):
        gguf.ensure(path, tmp_path / "out", F32)


def test_an_unknown_pre_tokenizer_is_named(tmp_path, tiny_model, vocab):
    path, _ = write(tmp_path, tiny_model, vocab, "qwen2", pre="made-up")
    with pytest.raises(gguf.GGUFError, match="pre-tokenizer 'made-up'"):
        gguf.ensure(path, tmp_path / "out", F32)


def test_a_file_that_is_no_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    assert gguf.is_gguf(bad) and not gguf.is_gguf(tmp_path / "missing")
    with pytest.raises(gguf.GGUFError, match="not a readable GGUF"):
        GGUFFile(bad)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    from worker.loading.gguf.families import llama3_rope

    config = {"head_dim": 64, "rope_theta": 500000.0}
    # The table llama.cpp computes for Llama 3.1 (factor 8), by its own formula.
    freqs = 1.0 / (500000.0 ** (np.arange(0, 64, 2) / 64))
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1) / 3
    table = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0,
                                                   1 / ((1 - smooth) / 8 + smooth)))
    scaling = llama3_rope(table.astype(np.float32), config)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    with pytest.raises(gguf.GGUFError, match="rope_freqs"):
        llama3_rope(np.linspace(1, 8, 32, dtype=np.float32), config)


def test_what_a_killed_conversion_left_is_removed(tmp_path, tiny_model, vocab):
    import os

    path, _ = write(tmp_path, tiny_model, vocab, "qwen2")
    dead = tmp_path / ".out.999999999.abc"      # no such process (beyond any pid_max)
    live = tmp_path / f".out.{os.getpid()}.abc"  # a conversion still running
    dead.mkdir()
    live.mkdir()
    gguf.ensure(path, tmp_path / "out", F32)
    assert not dead.exists() and live.exists()
