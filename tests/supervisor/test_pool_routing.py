"""What a request may load through the pool (issue #9, finding 5): one runner per real
path whatever the spelling, requests loading only inside the model roots (the admin
anywhere), absurd names the plain 404, a failed load on request forgotten, names looked
up on disk off the event loop."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.http.errors import APIError
from supervisor.workers.runner import READY
from tests.generates import generate
from tests.supervisor.errors_seen import raises_api
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_pool import (Worlds, broken_pinned, collect, make_pool, model_dir,
                                        until)


def shape(err: APIError, name: str) -> tuple:
    """What a client sees of an error, with the name it sent taken out."""
    return err.status, err.type, err.param, err.code, err.message.replace(name, "NAME")


async def not_found(call, *args) -> APIError:
    """The APIError that `call(*args)` raises (awaited if need be); it must be the 404."""
    with raises_api() as err:
        out = call(*args)
        if asyncio.iscoroutine(out):
            await out
    assert err.value.status == 404 and err.value.code == "model_not_found"
    return err.value


async def test_one_runner_per_real_path_whatever_the_spelling(tmp_path):
    root = tmp_path / "root"
    a = model_dir(root, "a")
    (root / "sub").mkdir()
    (tmp_path / "link").symlink_to(a)  # a link from outside the root to a model inside
    worlds = Worlds(FakeBehaviour(tokens=1))
    pool = make_pool(tmp_path, worlds, models_dirs=(root,))
    try:
        runner = await pool.get(f"{root}/./a")  # the first spelling names the model
        spellings = [a, f"{root}/sub/../a", a + "/", str(tmp_path / "link")]
        assert all([(await pool.get(s)) is runner for s in spellings])
        for s in spellings:
            assert await collect((await pool.get(s)).submit(generate(prompt="x"))) == "w1 "
        assert list(pool.runners) == [f"{root}/./a"]
        assert list(worlds.by_model) == [a]  # its worker loads the real path...
        assert len(worlds.by_model[a].links) == 1  # ...and there is one worker
    finally:
        await pool.stop()


async def test_demo_and_the_demo_directory_are_one_runner(tmp_path):
    demo_dir = model_dir(tmp_path / "models", "demo")  # as the worker builds it
    for first, second in (("demo", demo_dir), (demo_dir, "demo")):
        worlds = Worlds(FakeBehaviour(tokens=1))
        pool = make_pool(tmp_path, worlds, models_dirs=())  # STATE_DIR/models is a root
        try:
            runner = await pool.get(first)
            assert (await pool.get(second)) is runner and len(pool.runners) == 1
            assert await collect((await pool.get(second)).submit(generate(prompt="x"))) == "w1 "
            assert sum(len(w.links) for w in worlds.by_model.values()) == 1
        finally:
            await pool.stop()


async def test_requests_load_only_inside_the_roots_the_admin_anywhere(tmp_path):
    outside = model_dir(tmp_path / "outside", "m")
    worlds = Worlds(FakeBehaviour(tokens=1))
    pool = make_pool(tmp_path, worlds, models_dirs=(tmp_path / "root",))
    try:
        absent = str(tmp_path / "outside" / "nope")
        # One answer, whatever the reason; the reason goes to the log and the admin.
        assert (shape(await not_found(pool.get, outside), outside)
                == shape(await not_found(pool.get, absent), absent))
        assert not pool.runners and not worlds.by_model  # nothing was spawned
        assert [r["reason"] for r in pool.rejections][0].endswith("outside the model roots")
        runner = await pool.load(outside)  # mlxctl load: any local path
        assert runner.state == READY and (await pool.get(outside)) is runner  # routing is not loading
        assert (await pool.get(f"{tmp_path}/outside/./m")) is runner
    finally:
        await pool.stop()


@pytest.mark.parametrize("name", ["a" * 5000, "/" + "b" * 300, "/x/\0y", "\ud800", "/tmp/\udcff"])
async def test_absurd_names_are_the_plain_404_everywhere(tmp_path, name):
    pool = make_pool(tmp_path, Worlds())
    try:
        await not_found(pool.get, name)
        for admin_call in (pool.load, pool.unload, pool.kill):
            await not_found(admin_call, name)
        with raises_api() as err:
            await pool.swap(name)
        assert err.value.status == 404
        assert not pool.runners and "\0" not in pool.rejections[0]["model"]
    finally:
        await pool.stop()


async def test_a_failed_load_on_request_leaves_no_entry_and_may_be_retried(tmp_path):
    a = model_dir(tmp_path, "a")
    worlds = Worlds(FakeBehaviour(load_error="bad weights"))
    pool = make_pool(tmp_path, worlds)
    try:
        h = (await pool.get(a)).submit(generate(prompt="x"))
        with raises_api() as err:  # the client that asked gets the load error
            await h.started(5)
        assert err.value.status == 503 and "bad weights" in err.value.message
        await until(lambda: pool.find(a) is None)
        assert pool.health().workers == [] and a not in pool.created
        assert "bad weights" in pool.rejections[-1]["reason"]
        worlds.by_model[a].default = FakeBehaviour(tokens=1)  # fixed on disk meanwhile
        assert await collect((await pool.get(a)).submit(generate(prompt="x"))) == "w1 "
        assert len(worlds.by_model[a].links) == 2  # a second, fresh attempt
    finally:
        await pool.stop()


async def test_a_pinned_model_that_fails_to_load_stays_visible(tmp_path):
    pool, a, runner = await broken_pinned(tmp_path)
    try:
        await asyncio.sleep(0.05)
        assert pool.find(a) is runner
    finally:
        await pool.stop()


async def test_names_not_routed_are_looked_up_on_disk_off_the_event_loop(tmp_path, monkeypatch):
    import threading

    from supervisor.memory import catalog

    a = model_dir(tmp_path, "a")
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), models_dirs=(tmp_path,))
    threads = []
    real_target = catalog.target

    def spying(name, state_dir):
        threads.append(threading.current_thread())
        return real_target(name, state_dir)

    monkeypatch.setattr(catalog, "target", spying)
    try:
        runner = await pool.get(a)
        assert threads and threading.main_thread() not in threads  # the disk, in a thread
        seen = len(threads)
        assert await pool.get(a) is runner and len(threads) == seen  # routed: no disk at all
        await not_found(pool.get, str(tmp_path / "absent"))
        assert threading.main_thread() not in threads
    finally:
        await pool.stop()
