"""A worker group's faults that need a group of their own, in a file of its own so that
`make test`'s two processes (--dist loadfile) share the worker-group tests: a rank hung or
slow to start (heartbeats), a server that never gets healthy, and "hosts" in network
namespaces (the TCP and CURVE path). The groups that answer, stream, lose a rank and stop
are in test_worker_group.py, whose helpers these use.

Timing: as there, only the tests about silence shorten the heartbeat timeout."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench.serverproc import still_running
from tests.integration.test_worker_group import (  # noqa: F401 (fixtures)
    PROMPTS, SHORT_HEARTBEAT, _settle, _wait_epoch, complete, group_server, hostfile,
    rank_pids, reference, shard_model, slow_ranks)
from tests.serverproc import ServerProcess

pytestmark = pytest.mark.integration


def test_hung_rank_is_detected_and_the_group_respawns(shard_model, reference, tmp_path):
    with group_server(shard_model, tmp_path, 2, "tensor", *SHORT_HEARTBEAT) as s:
        old = rank_pids(s)
        os.kill(old[1], signal.SIGSTOP)  # idle: only its heartbeats can tell
        try:
            w = _wait_epoch(s, 2)
        finally:
            try:
                os.kill(old[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert w["restart_causes"].get("heartbeat", 0) >= 1, w
        assert "heartbeat" in (w["last_error"] or ""), w
        assert not set(old) & set(rank_pids(s))
        assert complete(s, shard_model, PROMPTS[0]) == reference[PROMPTS[0]]


def test_a_group_whose_ranks_start_slowly_keeps_its_heartbeat(shard_model, reference,
                                                              tmp_path):
    """A loaded machine: rank 1 starts 12 s late, well past the heartbeat timeout, and the
    leader waits for it in mx.distributed.init, unable to beat. The launcher beats until
    the leader's link does: the first group comes up (a kill would have marked the model
    broken: --crash-budget 0) and serves. Then the launcher beats no more: a leader that
    stops is killed for its silence."""
    env = slow_ranks(tmp_path, {"1"}, 12)
    with ServerProcess([shard_model], "--hosts", hostfile(tmp_path, 2), "--crash-budget", "0",
                       *SHORT_HEARTBEAT, env=env) as s:
        w = _settle(s)
        assert (w["state"], w["epoch"], w["restarts"]) == ("ready", 1, 0), w
        assert complete(s, shard_model, PROMPTS[0]) == reference[PROMPTS[0]]
        leader = rank_pids(s)[0]
        os.kill(leader, signal.SIGSTOP)
        try:
            w = _settle(s, ("broken",), timeout=60)
        finally:
            try:
                os.kill(leader, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert "no heartbeat for 6 s" in w["last_error"], w


def test_a_server_that_never_gets_healthy_leaves_no_process_behind(shard_model, tmp_path):
    """A fixture whose server fails to become healthy gets no teardown: wait_healthy
    stops mlxd and what it started (the launcher, mlx.launch, the ranks) before it
    raises."""
    env = slow_ranks(tmp_path, {"0", "1"}, 600)
    s = ServerProcess([shard_model], "--hosts", hostfile(tmp_path, 2), "--cancel-grace", "1",
                      env=env)
    try:
        deadline, started = time.monotonic() + 60, []
        while len(started) < 4 and time.monotonic() < deadline:  # launcher, mlx.launch, ranks
            time.sleep(0.2)
            started = s.descendants()
        assert len(started) >= 4, (started, s.log())
        with pytest.raises(TimeoutError, match="not healthy"):
            s.wait_healthy(1)
        assert s.proc.returncode is not None
        assert still_running(started) == []
    finally:
        s.stop()


# ---- "hosts" in network namespaces: the TCP and CURVE path --------------------------

SSH_SHIM = r"""#!/bin/bash
# mlx.launch's `ssh [-tt] [-o OPT] HOST CMD`, run in the network namespace named HOST.
# A host listed in MLXD_TEST_WRONG_KEYS gets another group's keys in place of ours.
while [[ "$1" == -* ]]; do
  if [[ "$1" == "-o" ]]; then shift; fi
  shift
done
host="$1"; shift
cmd="$*"
if [[ " $MLXD_TEST_WRONG_KEYS " == *" $host "* ]]; then
  cmd=$(printf '%s' "$cmd" | sed -E "s#MLXD_GROUP_KEYS=[^;]+;#MLXD_GROUP_KEYS=$MLXD_TEST_OTHER_KEYS;#")
fi
exec ip netns exec "$host" bash -c "$cmd"
"""


@pytest.fixture
def netns_host(tmp_path):
    """A second "host": the network namespace mlxdns1 (10.77.9.2), reached from this one
    (10.77.9.1) over a veth pair, and an `ssh` on PATH that runs commands inside it."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    ns, here, there = "mlxdns1", "10.77.9.1", "10.77.9.2"

    def ip(*args, netns=None):
        cmd = (["ip", "netns", "exec", netns] if netns else []) + ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True)

    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", "vmlxd0"], capture_output=True)
    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.decode().strip()}")
    try:
        ip("link", "add", "vmlxd0", "type", "veth", "peer", "name", "vmlxd1")
        ip("link", "set", "vmlxd1", "netns", ns)
        ip("addr", "add", f"{here}/24", "dev", "vmlxd0")
        ip("link", "set", "vmlxd0", "up")
        ip("addr", "add", f"{there}/24", "dev", "vmlxd1", netns=ns)
        ip("link", "set", "vmlxd1", "up", netns=ns)
        ip("link", "set", "lo", "up", netns=ns)
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "ssh").write_text(SSH_SHIM)
        (shim / "ssh").chmod(0o755)
        yield {"ns": ns, "here": here, "there": there, "path": str(shim)}
    finally:
        subprocess.run(["ip", "link", "del", "vmlxd0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def netns_hostfile(tmp_path, net) -> str:
    from worker.group.launch import free_ports

    path = tmp_path / "hosts-netns.json"
    path.write_text(json.dumps({
        "backend": "ring", "starting_port": free_ports(2), "control_port": free_ports(2),
        "hosts": [{"ssh": "127.0.0.1", "ips": [net["here"]]},
                  {"ssh": net["ns"], "ips": [net["there"]]}]}))
    return str(path)


def test_a_group_across_network_namespaces_serves_over_tcp_and_curve(
        shard_model, reference, tmp_path, netns_host):
    import subprocess

    env = {"PATH": f"{netns_host['path']}:{os.environ['PATH']}"}
    with ServerProcess([shard_model], "--hosts", netns_hostfile(tmp_path, netns_host),
                       env=env) as s:
        s.wait_healthy(180)
        follower = rank_pids(s)[1]
        in_ns = subprocess.run(["ip", "netns", "pids", netns_host["ns"]], capture_output=True,
                               text=True).stdout.split()
        assert str(follower) in in_ns  # rank 1 really runs on the other "host"
        for prompt in PROMPTS:
            assert complete(s, shard_model, prompt) == reference[prompt], prompt


def test_a_host_with_another_groups_keys_is_refused(shard_model, tmp_path, netns_host):
    from worker.group import keys

    other = keys.ensure(tmp_path / "other-state")
    env = {"PATH": f"{netns_host['path']}:{os.environ['PATH']}",
           "MLXD_TEST_WRONG_KEYS": netns_host["ns"], "MLXD_TEST_OTHER_KEYS": str(other)}
    # The rank with the wrong keys never reaches the control channel: the start fails when
    # --group-join-timeout runs out (30 s by default; short here, the test waits it out).
    with ServerProcess([shard_model], "--hosts", netns_hostfile(tmp_path, netns_host),
                       "--group-join-timeout", "5", env=env) as s:
        w = _settle(s)
        assert w["state"] == "broken", w
        assert "did not reach the leader's control channel" in w["last_error"], w
        assert "group-keys" in w["last_error"]
