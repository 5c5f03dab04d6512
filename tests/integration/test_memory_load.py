"""A worker's real MLX memory stays within the size the memory gate admitted it at, under
a concurrent mixed load (issue 30 item 8: after 64 clients a worker held 6.71 GiB while
idle, admitted at 1.88).

The real supervisor and worker, the tiny float32 model, a small KV budget so that the
admitted size is small next to what a load churns through: chat, completions,
Responses, Messages, streams and abandoned streams from 24 clients. The figures are the
worker's own heartbeats as /health shows them (MLX active memory, buffer cache, peak),
sampled all along, and the worker must not have been recycled. MLX's buffer cache is
given Metal's default room (there it may grow to the device's memory limit; the CPU
backend's default is 32 MiB) before the worker bounds it.
"""

from __future__ import annotations

import asyncio

from bench.memory_load import Sampler, idle, load
from bench.serverproc import REPO, ServerProcess

# Every process of the server imports this first (PYTHONPATH): MLX's buffer cache as
# roomy as on Metal.
METAL_DEFAULT = "import mlx.core as mx\nmx.set_cache_limit(1 << 40)\n"


def test_a_worker_under_load_stays_within_its_admitted_size(tiny_model, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(METAL_DEFAULT)
    with ServerProcess([str(tiny_model)], "--kv-budget", "16M", "--prompt-cache-bytes", "8M",
                       "--max-queue", "256", "--queue-timeout", "300",
                       state_dir=tmp_path,
                       env={"PYTHONPATH": f"{REPO}:{tmp_path / 'site'}"}) as srv:
        srv.wait_healthy()
        sampler = Sampler(srv, every=0.05)
        sampler.start()
        tally = asyncio.run(load(srv, str(tiny_model), clients=24, requests=72, words=300,
                                 seed=3))
        idle(srv, 3.0)
        sampler.stop.set()
        sampler.join()
        after = sampler.read()
    w, high = after["worker"], sampler.highest
    need = w["need_bytes"]
    assert tally.counts["served"] == 72, tally.examples
    assert w["restarts"] == 0 and not w["restart_causes"], w["last_error"]
    assert 0 < after["active"] and high["total"] > after["active"]  # it was sampled busy
    assert high["total"] <= need, f"active + cache {high['total']} over admitted {need}"
    assert after["total"] <= need and after["peak"] <= need, (after, need)
