"""A swap that needs memory unloads the model it replaces before any other (pool.py
`_victim`): the least recently used idle model is only the victim of last resort, and a
swap must not take a model it was not asked to replace."""

from __future__ import annotations

from supervisor.workers.runner import DRAIN, READY
from tests.generates import generate
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_pool import GiB, Memory, Worlds, collect, make_pool, model_dir


async def test_a_swap_unloads_what_it_replaces_not_the_least_recently_used(tmp_path):
    keep = model_dir(tmp_path, "keep", 4 * GiB)
    old = model_dir(tmp_path, "old", 4 * GiB)
    new = model_dir(tmp_path, "new", 6 * GiB)
    pool = make_pool(tmp_path, Worlds(FakeBehaviour(tokens=1)), Memory(capacity=12 * GiB))
    try:
        kept = await pool.get(keep)
        assert await collect(kept.submit(generate(prompt="x"))) == "w1 "
        replaced = await pool.get(old)
        assert await collect(replaced.submit(generate(prompt="x"))) == "w1 "
        assert kept.last_used < replaced.last_used and kept.evictable  # the LRU idle one
        result = await pool.swap(new, DRAIN, replace=[old])
        assert result.replaced == [old]
        assert set(pool.runners) == {keep, new} and pool.find(new).state == READY
        assert kept.state == READY and replaced.state == "stopped"
    finally:
        await pool.stop()
