"""Deleting a model from the Hugging Face cache: the shared function (only a repo id's
own folder, partial pulls included) and `POST /admin/delete` against fake workers
(refused while any runner uses a directory inside that folder, under any name)."""

from __future__ import annotations

import pytest

from supervisor.memory.hf_delete import NotCached, delete_cached, repo_folder
from tests.hfcache import add_to_cache
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_admin import admin_client
from tests.supervisor.test_catalog import model
from tests.supervisor.test_pool import Worlds, model_dir


@pytest.fixture
def cache(hf_cache):
    """The empty HF cache huggingface_hub's lookups (and the delete) use (conftest)."""
    return hf_cache


def test_delete_removes_that_repos_folder_and_nothing_else(tmp_path, cache):
    add_to_cache(model_dir(tmp_path / "src", "a", weights=5000), cache, "org/a")
    add_to_cache(model_dir(tmp_path / "src", "b"), cache, "org/b")
    (cache / ".locks" / "models--org--a").mkdir(parents=True)
    path, freed = delete_cached("org/a")
    assert path == cache / "models--org--a" and not path.exists()
    # The blobs and the ref (40 bytes of commit), not the snapshot's links.
    assert freed == 5000 + len('{"max_position_embeddings": 128}') + 40
    assert not (cache / ".locks" / "models--org--a").exists()
    assert (cache / "models--org--b" / "refs" / "main").is_file()
    with pytest.raises(NotCached):
        delete_cached("org/a")


def test_a_pull_stopped_before_any_snapshot_is_deleted_too(cache):
    blobs = cache / "models--org--half" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / ("e" * 64 + ".mlxd-part")).write_bytes(b"x" * 1234)
    path, freed = delete_cached("org/half")
    assert freed == 1234 and not path.exists()


@pytest.mark.parametrize("name", ["/tmp/x", "./m", "~/m", "demo", "org/x--y", "org/..",
                                  "a/b/c", "org/", "", "org/a b"])
def test_only_repo_ids_are_deleted(name, cache):
    with pytest.raises(ValueError, match="not a Hugging Face repo id"):
        repo_folder(name)
    with pytest.raises(ValueError):
        delete_cached(name)


async def test_the_endpoint_refuses_a_loaded_model_under_any_name(tmp_path, cache):
    snap = add_to_cache(model(tmp_path / "src", "m"), cache, "org/m")   # an MLX model
    folder = cache / "models--org--m"
    client = await admin_client(tmp_path, Worlds(FakeBehaviour()))
    h = client.headers
    try:
        listed = (await (await client.get("/admin/models", headers=h)).json())["models"]
        assert "org/m" in {m["id"] for m in listed}
        r = await client.post("/admin/load", json={"model": str(snap)}, headers=h)   # by its path
        assert r.status == 200, await r.text()
        r = await client.post("/admin/delete", json={"model": "org/m"}, headers=h)
        body = await r.json()
        assert r.status == 409 and body["error"]["code"] == "model_loaded"
        assert f"loaded as `{snap}`" in body["error"]["message"] and folder.is_dir()

        assert (await client.post("/admin/unload", json={"model": str(snap)}, headers=h)).status == 200
        r = await client.post("/admin/delete", json={"model": "org/m"}, headers=h)
        body = await r.json()
        assert r.status == 200, body
        assert body["path"] == str(folder) and body["freed_bytes"] > 0 and not folder.exists()
        listed = (await (await client.get("/admin/models", headers=h)).json())["models"]
        assert "org/m" not in {m["id"] for m in listed}

        r = await client.post("/admin/delete", json={"model": "org/m"}, headers=h)
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        for bad in ({"model": str(tmp_path / "src" / "m")}, {"model": 3}, {}):
            r = await client.post("/admin/delete", json=bad, headers=h)
            assert r.status == 400, bad
        assert (tmp_path / "src" / "m" / "config.json").is_file()
    finally:
        await client.close()


async def test_the_listing_forgets_a_deleted_model_at_once(tmp_path, cache):
    add_to_cache(model(tmp_path / "src", "m"), cache, "org/m")
    client = await admin_client(tmp_path, Worlds(FakeBehaviour()))
    try:
        async def ids():
            return {m["id"] for m in (await (await client.get("/v1/models")).json())["data"]}
        assert "org/m" in await ids()     # listed, and the listing cached
        r = await client.post("/admin/delete", json={"model": "org/m"}, headers=client.headers)
        assert r.status == 200
        assert "org/m" not in await ids()
    finally:
        await client.close()
