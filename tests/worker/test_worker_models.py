"""Model resolution (local path, HF cache only, never a download) and context length."""

from __future__ import annotations

import shutil

import pytest

from worker.loading import models


@pytest.mark.parametrize("config,expected", [
    ({"max_position_embeddings": 32768}, 32768),
    ({"text_config": {"max_position_embeddings": 8192}}, 8192),
    ({"max_sequence_length": 2048}, 2048),
    ({"seq_length": 1024}, 1024),
    ({"n_ctx": 512}, 512),
    ({"max_position_embeddings": 100, "n_ctx": 5}, 100),
    ({}, 4096),
    ({"max_position_embeddings": None}, 4096),
])
def test_context_length_from_config(config, expected):
    assert models.context_length(config) == expected


def test_max_context_tokens_overrides_the_config():
    assert models.context_length({"max_position_embeddings": 32768}, 64) == 64
    assert models.context_length({}, 100000) == 100000


def test_local_directory_resolves_to_itself(tiny_model, tmp_path):
    assert models.resolve(str(tiny_model), tmp_path) == tiny_model


@pytest.mark.parametrize("name", ["/no/such/model", "./nope", "~/nope-mlxd-test"])
def test_missing_local_path_is_a_load_error(name, tmp_path):
    with pytest.raises(models.LoadError) as e:
        models.resolve(name, tmp_path)
    assert name in str(e.value)


def test_repo_not_in_cache_is_a_clear_error_and_no_download(tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(models.LoadError) as e:
        models.resolve("mlxd-test/not-a-real-model", tmp_path)
    msg = str(e.value)
    assert "not a local path and not in the Hugging Face cache" in msg
    assert "mlxctl pull mlxd-test/not-a-real-model" in msg
    assert not (tmp_path / "hf" / "models--mlxd-test--not-a-real-model").exists()


def test_repo_in_the_hf_cache_resolves_to_its_snapshot(tiny_model, tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    # The layout huggingface_hub writes: refs/main names the snapshot directory.
    repo = tmp_path / "hf" / "models--mlxd-test--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path / "hf"))
    path = models.resolve("mlxd-test/tiny", tmp_path)
    assert path == snap
    assert (path / "config.json").exists()


def test_load_reports_context_vocab_and_random_weights(tiny_loaded, tiny_model):
    assert tiny_loaded.path == tiny_model
    assert tiny_loaded.context_length == 4096
    assert tiny_loaded.vocab_size >= len(tiny_loaded.tokenizer)
    assert tiny_loaded.random_weights is True


def test_broken_model_directory_is_a_load_error(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "no-such-arch"}')
    with pytest.raises(models.LoadError) as e:
        models.load(str(tmp_path / "broken"), tmp_path)
    assert "could not load model" in str(e.value)
