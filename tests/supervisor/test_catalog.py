"""The local model catalog: names that may load, weights on disk, MLX detection, the
Hugging Face cache scan (a hand-built cache; nothing is downloaded)."""

from __future__ import annotations

import json
import struct

import pytest

from supervisor import catalog
from tests.hfcache import add_to_cache


def safetensors(path, metadata: dict | None, payload: int = 64) -> None:
    header = {"w": {"dtype": "F32", "shape": [payload // 4], "data_offsets": [0, payload]}}
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * payload)


def model(root, name, *, fmt="mlx", config=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config or {"max_position_embeddings": 2048}))
    safetensors(d / "model.safetensors", {"format": fmt} if fmt else None)
    return d


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache that huggingface_hub's lookups use."""
    import huggingface_hub.constants as constants
    import huggingface_hub.utils._cache_manager as manager

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(manager, "HF_HUB_CACHE", str(cache))
    return cache


def test_loadable_names(tmp_path, hf_cache):
    local = model(tmp_path, "local")
    add_to_cache(model(tmp_path / "src", "x"), hf_cache, "org/cached")
    assert catalog.loadable(str(local), tmp_path)
    assert catalog.loadable("demo", tmp_path)          # built on first use
    assert catalog.loadable("org/cached", tmp_path)
    assert not catalog.loadable("org/absent", tmp_path)
    assert not catalog.loadable(str(tmp_path / "nope"), tmp_path)
    assert not catalog.loadable("../../etc", tmp_path)
    (tmp_path / "empty").mkdir()
    assert not catalog.loadable(str(tmp_path / "empty"), tmp_path)  # no config.json
    assert (catalog.resolve("org/cached", tmp_path) / "model.safetensors").is_file()


def test_mlx_detection(tmp_path):
    assert catalog.is_mlx_model(model(tmp_path, "mlx"))
    assert not catalog.is_mlx_model(model(tmp_path, "pt", fmt="pt"))
    assert catalog.is_mlx_model(model(tmp_path, "q", fmt=None, config={"quantization": {"bits": 4}}))
    assert catalog.is_mlx_model(model(tmp_path, "c", fmt=None), "mlx-community/whatever")
    broken = model(tmp_path, "broken")
    (broken / "model.safetensors").write_bytes(b"\xff" * 4)
    assert not catalog.is_mlx_model(broken)


def test_scan_lists_mlx_models_of_the_cache_with_size_and_context(tmp_path, hf_cache):
    add_to_cache(model(tmp_path / "src", "a", config={"max_position_embeddings": 8192}),
                 hf_cache, "mlx-community/a-4bit")
    add_to_cache(model(tmp_path / "src", "b", fmt="pt"), hf_cache, "someone/pytorch-only")
    found = catalog.scan(tmp_path / "state", cache_dir=hf_cache)
    assert [m.id for m in found] == ["mlx-community/a-4bit"]
    m = found[0]
    assert m.source == "hf-cache" and m.context_length == 8192
    assert m.size_bytes == (tmp_path / "src" / "a" / "model.safetensors").stat().st_size
    assert catalog.scan(tmp_path / "state", cap=1024, cache_dir=hf_cache)[0].context_length == 1024


def test_scan_without_a_cache_and_with_demo_built(tmp_path):
    state = tmp_path / "state"
    assert catalog.scan(state, cache_dir=tmp_path / "no-cache") == []
    model(state / "models", "demo")
    assert [m.id for m in catalog.scan(state, cache_dir=tmp_path / "no-cache")] == ["demo"]
