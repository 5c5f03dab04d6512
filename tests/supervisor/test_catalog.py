"""The local model catalog: names that may load, weights on disk, MLX detection, the
Hugging Face cache scan (a hand-built cache; nothing is downloaded)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from supervisor.memory import catalog
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


# ---- what a request may load (issue #9: findings 5 and 6b) ------------------------------

ABSURD = ["a" * 5000, "/" + "b" * 300, "x/" + "é" * 128, "/tmp/\0nul", "\ud800", "/tmp/\udcff",
          "", "~no-such-user-mlxd/m", "org/" + "c" * 300]


@pytest.fixture
def roots(tmp_path, hf_cache):
    """A --models-dir root holding model `m`, a directory outside every root holding a
    model too, and the model roots a pool of state dir tmp_path/state would use."""
    root = tmp_path / "root"
    model(root, "m")
    model(tmp_path / "outside", "m")
    return catalog.model_roots(tmp_path / "state", (root,))


def test_model_roots_are_the_hf_cache_the_state_models_and_the_models_dirs(tmp_path, hf_cache):
    (tmp_path / "real-root").mkdir()
    (tmp_path / "link-root").symlink_to(tmp_path / "real-root")
    found = catalog.model_roots(tmp_path / "state", (tmp_path / "link-root",))
    assert found == [hf_cache, tmp_path / "state" / "models", tmp_path / "real-root"]


def test_every_spelling_of_a_model_leads_to_one_real_path(tmp_path, roots):
    m = tmp_path / "root" / "m"
    (tmp_path / "root" / "sub").mkdir()
    (tmp_path / "alias").symlink_to(m)  # the link lies outside the roots; its target inside
    spellings = [str(m), f"{m.parent}/./m", f"{m.parent}/sub/../m", str(tmp_path / "alias"),
                 str(m) + "/"]
    targets = {catalog.request_target(s, tmp_path / "state", roots) for s in spellings}
    assert targets == {catalog.Target(str(m), str(m))}  # the worker loads the real path


def test_only_models_inside_the_roots_by_real_path_may_be_requested(tmp_path, roots):
    state, outside = tmp_path / "state", tmp_path / "outside" / "m"
    (tmp_path / "root" / "escape").symlink_to(outside)  # inside by name, outside for real
    for name in (str(outside), str(tmp_path / "root" / "escape"), f"{tmp_path}/root/../outside/m"):
        assert catalog.loadable(name, state)                     # a model: the admin may load it
        assert catalog.request_target(name, state, roots) is None  # a request may not
        assert "outside the model roots" in catalog.refusal(name, catalog.target(name, state), roots)


def test_demo_and_its_directory_are_one_model(tmp_path, roots):
    state = tmp_path / "state"
    demo = catalog.request_target("demo", state, roots)
    assert demo == catalog.Target(str(state / "models" / "demo"), "demo")  # before it is built
    model(state / "models", "demo")
    assert catalog.request_target(str(state / "models" / "demo"), state, roots).real == demo.real


def test_a_cached_repo_is_loaded_by_id_from_inside_the_hf_cache(tmp_path, roots, hf_cache):
    snapshot = add_to_cache(model(tmp_path / "src", "x"), hf_cache, "org/cached")
    found = catalog.request_target("org/cached", tmp_path / "state", roots)
    assert found == catalog.Target(str(snapshot), "org/cached")
    assert catalog.request_target(str(snapshot), tmp_path / "state", roots).real == found.real


def test_absent_unloadable_and_outside_give_one_answer_and_a_reason_each(tmp_path, roots):
    state = tmp_path / "state"
    (tmp_path / "root" / "empty").mkdir()
    (tmp_path / "root" / "file").write_text("x")
    names = {"absent": str(tmp_path / "root" / "nope"), "no config": str(tmp_path / "root" / "empty"),
             "a file": str(tmp_path / "root" / "file"), "outside": str(tmp_path / "outside" / "m"),
             "absurd": "a" * 5000}
    reasons = set()
    for name in names.values():
        assert catalog.request_target(name, state, roots) is None
        reasons.add(catalog.refusal(name, catalog.target(name, state), roots))
    assert len(reasons) == 3 and "" not in reasons  # absent/not a model, outside, absurd


@pytest.mark.parametrize("name", ABSURD)
def test_absurd_names_name_nothing_and_never_raise(tmp_path, roots, name):
    state = tmp_path / "state"
    assert catalog.target(name, state) is None and not catalog.loadable(name, state)
    assert catalog.resolve(name, state) is None and catalog.describe(name, state) is None
    assert catalog.request_target(name, state, roots) is None
    assert "\0" not in catalog.shown(name) and len(catalog.shown(name)) < 200


def test_name_limits_are_the_filesystems(tmp_path):
    assert catalog.sane_name("/" + "a" * 255) and not catalog.sane_name("/" + "a" * 256)
    assert catalog.sane_name("é" * 127) and not catalog.sane_name("é" * 128)  # bytes count
    assert catalog.sane_name("/a" * 512) and not catalog.sane_name("/a" * 513)
    assert not catalog.sane_name(None) and not catalog.sane_name(["demo"])


def test_a_name_too_long_only_once_expanded_is_no_error(tmp_path, monkeypatch):
    # Short as written, past PATH_MAX once `~` expands: the OS says ENAMETOOLONG, the
    # catalog says "no model".
    monkeypatch.setenv("HOME", "/" + "h/" * 2100)
    with pytest.raises(OSError):
        (Path("~/m").expanduser() / "config.json").is_file()
    assert catalog.sane_name("~/m")
    assert catalog.target("~/m", tmp_path) is None and catalog.resolve("~/m", tmp_path) is None
