"""The one model reference both processes resolve names by (protocol/model_ref.py): each
kind from hand-built files (demo names, a GGUF file and its conversions, an Ollama
library, a model directory, a Hugging Face cache snapshot) and the unknown, in words."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from protocol import model_ref, models
from protocol.model_ref import ModelRef, RefKind
from tests.hfcache import add_to_cache, hf_cache  # noqa: F401  (a fixture)


def model_dir(path, weights: int = 64):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (path / "model.safetensors").write_bytes(b"\0" * weights)
    return path


def gguf(path):
    path.write_bytes(model_ref.GGUF_MAGIC + b"\0" * 60)
    return path


@pytest.mark.parametrize("name", model_ref.BUILT_DEMOS)
def test_demo_names_are_built_in_the_state_directory(tmp_path, name):
    ref = model_ref.resolve(name, tmp_path)
    assert ref == ModelRef(name, RefKind.DEMO, tmp_path / "models" / name)
    assert not ref.gguf and ref.conversions() == []


def test_a_demo_weighs_its_build_else_the_gguf_it_is_converted_from(tmp_path, monkeypatch):
    packaged = gguf(tmp_path / "SmolLM2.gguf")
    monkeypatch.setattr(model_ref, "demo_gguf", lambda: packaged)
    demo, random = (model_ref.resolve(n, tmp_path) for n in ("demo", "demo-random"))
    assert demo.packaged_gguf() == packaged and random.packaged_gguf() is None
    assert demo.weights_path() == packaged and random.weights_path() is None  # not built
    built = model_dir(tmp_path / "models" / "demo-random")
    assert random.weights_path() == built


def test_a_gguf_file_and_its_conversions(tmp_path):
    file, state = gguf(tmp_path / "m.gguf"), tmp_path / "state"
    ref = model_ref.resolve(str(file), state)
    assert ref == ModelRef(str(file), RefKind.GGUF, file) and ref.gguf
    assert ref.conversions() == [] and ref.weights_path() == file  # not converted yet
    # As a worker leaves it: the file's hash recorded, one directory per set of options.
    root = models.gguf_root(state)
    root.mkdir(parents=True)
    (root / models.GGUF_HASHES).write_text(json.dumps({os.path.realpath(file): {
        "stamp": models.file_stamp(file), "sha256": "ab" * 32}}))
    small, big = model_dir(root / f"{'ab' * 8}-a", 8), model_dir(root / f"{'ab' * 8}-b", 512)
    assert ref.conversions() == [small, big]
    assert ref.weights_path() == big  # the memory gate counts the largest


def test_a_file_that_is_no_gguf_is_unknown(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("hello")
    monkeypatch.chdir(tmp_path)  # a relative name that exists is a path, not a repo id
    for name in (str(tmp_path / "notes.txt"), "notes.txt"):
        ref = model_ref.resolve(name, tmp_path)
        assert ref.kind is RefKind.UNKNOWN and ref.path is None and ref.weights_path() is None
        assert ref.why == f"model {name} is not a model directory or a GGUF file"


def test_an_ollama_name_is_its_blob(tmp_path, monkeypatch):
    library = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(library))
    digest = "cd" * 32
    (library / "blobs").mkdir(parents=True)
    blob = gguf(library / "blobs" / f"sha256-{digest}")
    manifest = library.joinpath("manifests", "registry.ollama.ai", "library", "tiny", "q4")
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": model_ref.OLLAMA_MODEL_LAYER, "digest": f"sha256:{digest}"}]}))
    ref = model_ref.resolve("ollama:tiny:q4", tmp_path)
    assert ref == ModelRef("ollama:tiny:q4", RefKind.OLLAMA, blob) and ref.gguf
    absent = model_ref.resolve("ollama:tiny", tmp_path)  # tag `latest`: no manifest
    assert absent.kind is RefKind.UNKNOWN
    assert absent.why == f"ollama:tiny is not a model in the local Ollama library ({library})"


def test_a_directory_is_itself(tmp_path):
    d = model_dir(tmp_path / "m")
    assert model_ref.resolve(str(d), tmp_path) == ModelRef(str(d), RefKind.DIRECTORY, d)
    (tmp_path / "empty").mkdir()  # a directory still; the supervisor wants a config.json
    assert model_ref.resolve(str(tmp_path / "empty"), tmp_path).kind is RefKind.DIRECTORY


def test_a_repo_id_is_its_snapshot_in_the_hub_cache(tmp_path, hf_cache):  # noqa: F811
    snapshot = add_to_cache(model_dir(tmp_path / "src"), hf_cache, "org/cached")
    ref = model_ref.resolve("org/cached", tmp_path)
    assert ref == ModelRef("org/cached", RefKind.HUB, snapshot)
    assert ref.weights_path() == snapshot
    absent = model_ref.resolve("org/absent", tmp_path)
    assert absent.kind is RefKind.UNKNOWN and absent.why == model_ref.not_cached("org/absent")
    assert "mlxctl pull org/absent" in absent.why


@pytest.mark.parametrize("name, why", [
    ("/no/such/model", "not a model directory"), ("./nope", "not a model directory"),
    ("~no-such-user-mlxd/m", "not a model directory"), ("plain", "not in the Hugging Face"),
    ("a" * 5000, "not in the Hugging Face"), ("/" + "b" * 300, "not a model directory"),
    ("/tmp/\0nul", "not a model directory"), ("\ud800", "not in the Hugging Face"),
])
def test_anything_else_is_unknown_and_never_raises(tmp_path, hf_cache, name, why):  # noqa: F811
    ref = model_ref.resolve(name, tmp_path)
    assert ref.kind is RefKind.UNKNOWN and ref.path is None and why in ref.why


def test_a_reference_is_a_frozen_value(tmp_path):
    ref = model_ref.resolve("demo", tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.path = tmp_path
    assert {ref, model_ref.resolve("demo", tmp_path)} == {ref}
