"""A worker group's rank that cannot see its GPU (issue 36): it leaves before joining the
group (NCCL's init would fail with 'invalid usage' or hang), with a log line naming the
cause, and the launcher sends that cause to the supervisor as the load's Error, which makes
the model's requests a retryable 503 naming it. On this CPU no rank sees a GPU: the real
mlx.launch with the NCCL backend's settings gives exactly that case."""

from __future__ import annotations

import json
import subprocess
import sys

import zmq

from protocol.exits import EXIT_LOAD_FAILED
from protocol.messages import LOAD_FAILED
from worker.group import launch
from worker.group.rank import cause_file, device_problem


def test_only_an_nccl_rank_without_a_gpu_is_refused():
    assert device_problem("ring", False, False, "1", None, "h") is None
    assert device_problem("nccl", True, True, "1", "1", "h") is None
    why = device_problem("nccl", False, False, "1", "3", "gpu-host")
    assert "rank 1" in why and "gpu-host" in why and "CUDA_VISIBLE_DEVICES=3" in why
    assert "(unset)" in device_problem("nccl", True, False, "0", None, "h")


def test_ranks_of_a_real_mlx_launch_without_their_gpu_leave_and_the_launcher_says_why(
        tmp_path, monkeypatch):
    from protocol import decode_up, sockets
    from protocol.hosts import read_hostfile

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "nccl", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}))
    exit_file = str(tmp_path / "exit")
    rank = ("import sys; from worker.group.rank import check_device, fail_before_join, "
            "pin_device; pin_device(); p = check_device(); "
            "sys.exit(fail_before_join(p) if p else 0)")
    cmd = launch.launch_command(hostfile, read_hostfile(hostfile), exit_file,
                                [sys.executable, "-c", rank], tmp_path / "keys")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, cwd=launch.__file__.rsplit("/worker/", 1)[0])
    assert "load failed: rank" in out.stderr and "cannot see its GPU" in out.stderr, out.stderr
    assert open(exit_file).read().strip() == str(EXIT_LOAD_FAILED)
    assert "cannot see its GPU" in cause_file(exit_file).read_text()

    runtime = sockets.make_runtime_dir()
    ep = sockets.Endpoints.for_worker(runtime, "devices")
    ctx = zmq.Context()
    events = sockets.pull(ctx, ep.events, bind=True)
    worker = ["python", "-m", "worker", "--model", "m", "--commands", ep.commands,
              "--events", ep.events, "--epoch", "4", "--group"]
    try:
        assert launch.report_cause(worker, cause_file(exit_file))
        assert events.poll(10_000)
        err = decode_up(events.recv())
        assert (err.kind, err.epoch, err.code, err.rid) == ("error", 4, LOAD_FAILED, None)
        assert "cannot see its GPU" in err.message and "CUDA_VISIBLE_DEVICES=" in err.message
        assert not cause_file(exit_file).exists()
        assert not launch.report_cause(worker, cause_file(exit_file))  # once
    finally:
        events.close()
        ctx.term()
        sockets.remove_runtime_dir(runtime)


def test_ranks_on_gpus_of_their_own_are_judged_each_against_its_gpu():
    from worker.group.setup import memory_problem

    GiB = 1 << 30

    def rank(host, device, free, need):
        return {"host": host, "device": device, "free": free * GiB, "need": need * GiB}

    # Two ranks on two GPUs of one host, 60 GiB each: each GPU holds its own.
    assert memory_problem([rank("a", "0", 78, 60), rank("a", "1", 78, 60)]) is None
    # The same ranks on one memory (CPU ranks, or both on GPU 0): they add up.
    why = memory_problem([rank("a", None, 78, 60), rank("a", None, 78, 60)])
    assert "host a cannot hold its 2 rank(s)" in why
    assert "GPU 1" in memory_problem([rank("a", "0", 78, 60), rank("a", "1", 50, 60)])
