"""The memory gate for a worker group on several GPUs of one host (issue 36): each rank's
share is judged against its own GPU's free memory, so a model larger than one GPU is
admitted where the group's GPUs together hold it; without a reading per GPU the ranks
share the one memory read, as before."""

from __future__ import annotations

import json

from supervisor.config import Config
from supervisor.memory.gate import MemoryGate
from supervisor.memory.probe import NORMAL, DeviceProbe, MemoryReading, parse_gpus

GiB = 1 << 30


def gate(tmp_path, **cfg) -> MemoryGate:
    return MemoryGate(Config(state_dir=tmp_path, **cfg), probe=lambda: None)


def gpu0(free: int, gpus=()) -> MemoryReading:
    return MemoryReading(free, 80 * GiB, NORMAL, "mlx-cuda", gpus=tuple(gpus))


def test_a_group_larger_than_one_gpu_is_admitted_where_its_gpus_hold_it(tmp_path):
    g = gate(tmp_path)
    need = 120 * GiB  # two ranks here: 60 GiB each
    assert not g.judge(need, gpu0(78 * GiB), ranks_here=2).fits  # GPU 0 alone read
    v = g.judge(need, gpu0(78 * GiB, [78 * GiB, 78 * GiB]), ranks_here=2)
    assert v.fits and v.free_bytes == 156 * GiB
    v = g.judge(need, gpu0(78 * GiB, [78 * GiB, 50 * GiB]), ranks_here=2)  # GPU 1 busy
    assert not v.fits and v.free_bytes == 100 * GiB and "not enough" in v.reason
    # Another load on its way takes its part of each GPU.
    assert not g.judge(need, gpu0(78 * GiB, [78 * GiB] * 2), ranks_here=2,
                       reserved=40 * GiB).fits
    # A single-process model is judged by its own GPU (the default device) only.
    assert not g.judge(need, gpu0(78 * GiB, [78 * GiB] * 2)).fits
    # --memory-budget covers the machine: the group's whole need counts against it.
    assert gate(tmp_path, memory_budget=160 * GiB).judge(
        need, gpu0(78 * GiB, [78 * GiB] * 2), ranks_here=2).fits
    v = gate(tmp_path, memory_budget=100 * GiB).judge(
        need, gpu0(78 * GiB, [78 * GiB] * 2), ranks_here=2)
    assert not v.fits and "budget" in v.reason


def test_the_device_probe_reads_every_visible_gpu():
    out = json.dumps({"cuda": True, "info": {"total_memory": 80 * GiB, "free_memory": 70 * GiB},
                      "gpus": [70 * GiB, 60 * GiB]})
    assert parse_gpus(out) == (70 * GiB, 60 * GiB)
    assert parse_gpus('{"cuda": false, "info": {}}') == () and parse_gpus("junk") == ()
    host = lambda: MemoryReading(100 * GiB, 128 * GiB, NORMAL)  # noqa: E731
    r = DeviceProbe(host, run=lambda: out)()
    assert r.source == "mlx-cuda" and r.available_bytes == 70 * GiB
    assert r.gpus == (70 * GiB, 60 * GiB)


def test_a_memory_file_may_stand_in_for_the_gpus(tmp_path):
    # bench.multihost --fits-across checks the admission on a CPU with stand-in GPUs.
    from supervisor.memory.probe import FileProbe

    path = tmp_path / "memory.json"
    path.write_text(json.dumps({"available_bytes": 30 * GiB, "gpus": [30 * GiB, 30 * GiB]}))
    host = lambda: MemoryReading(100 * GiB, 128 * GiB, NORMAL)  # noqa: E731
    r = FileProbe(path, host)()
    assert r.available_bytes == 30 * GiB and r.gpus == (30 * GiB, 30 * GiB)
    g = gate(tmp_path)
    assert not g.judge(40 * GiB, r).fits and g.judge(40 * GiB, r, ranks_here=2).fits
    path.write_text(json.dumps({"available_bytes": 30 * GiB}))
    assert FileProbe(path, host)().gpus == ()
