"""Starting a worker group (worker/group/launch.py): the hostfile checked, a local group's
ports drawn free and below the ephemeral range, the launcher beating for the group until
the leader's link does."""

from __future__ import annotations

import json
import threading

import pytest
import zmq

from worker.group import launch


def test_hostfile_is_checked_and_local_groups_get_free_ports(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"ssh": "127.0.0.1"}]))
    with pytest.raises(ValueError, match="at least two hosts"):
        launch.read_hostfile(bad)
    good = tmp_path / "hosts.json"
    good.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]}))
    data = launch.read_hostfile(good)
    cmd = launch.launch_command(good, data, "/x/exit", ["python", "-m", "worker"],
                                tmp_path / "keys")
    assert cmd[-4:] == ["--", "python", "-m", "worker"]
    envs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--env"]
    control = next(e for e in envs if e.startswith("MLXD_GROUP_CONTROL="))
    assert control.startswith("MLXD_GROUP_CONTROL=tcp://127.0.0.1:")
    # The control channel's ports follow the ring's two (one draw: they cannot overlap).
    ring = int(cmd[cmd.index("--starting-port") + 1])
    assert int(control.rsplit(":", 1)[1]) == ring + 2
    assert "MLXD_GROUP_EXIT_FILE=/x/exit" in envs and "MLXD_GROUP_BACKEND=ring" in envs
    assert f"MLXD_GROUP_KEYS={tmp_path / 'keys'}" in envs
    assert "MLXD_GROUP_LINK_UP=/x/exit.up" in envs   # where the launcher looks for it
    remote = {"hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}],
              "backend": "ring", "control_port": 4000}
    cmd = launch.launch_command(good, remote, "/x/exit", ["w"], tmp_path / "keys")
    assert "MLXD_GROUP_CONTROL=tcp://10.0.0.1:4000" in cmd
    assert cmd[cmd.index("--starting-port") + 1] == "32323"


def test_local_groups_take_ports_below_the_ephemeral_range(tmp_path):
    """A rank binds its port seconds after the launcher chose it: a port outgoing
    connections may take meanwhile (the ephemeral range) would fail its join."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert launch.ephemeral_from(ranges) == 32768
    assert launch.ephemeral_from(tmp_path / "absent") == launch.EPHEMERAL_FROM == 49152
    low = launch.ephemeral_from()
    picks = [launch.free_ports(3) for _ in range(50)]
    assert all(20000 <= p and p + 3 <= low for p in picks), (low, picks)
    assert len(set(picks)) > 1   # drawn, not one fixed port


def test_the_launcher_beats_for_the_group_until_the_leaders_link_does(tmp_path):
    """The ranks start in silence (the leader's link cannot beat before the group is
    joined): the launcher beats, with the worker's epoch and interval, until the leader's
    file says its link beats, or mlx.launch has ended."""
    from protocol import decode_up, sockets

    runtime = sockets.make_runtime_dir()
    ep = sockets.Endpoints.for_worker(runtime, "launch")
    ctx = zmq.Context()
    events = sockets.pull(ctx, ep.events, bind=True)
    worker = ["python", "-m", "worker", "--model", "m", "--commands", ep.commands,
              "--events", ep.events, "--epoch", "7", "--heartbeat-interval", "0.01", "--group"]
    up, done = tmp_path / "exit.up", threading.Event()
    sent = []
    beater = threading.Thread(target=lambda: sent.append(launch.beat_until_up(worker, up, done)))
    try:
        beater.start()
        beats = []
        while len(beats) < 3 and events.poll(10_000):
            beats.append(decode_up(events.recv()))
        assert {(b.kind, b.epoch, b.state) for b in beats} == {("heartbeat", 7, "loading")}
        assert len(beats) == 3
        up.touch()   # the leader's link beats now
        beater.join(10)
        assert not beater.is_alive() and sent[0] >= 3
        assert launch.beat_until_up(worker, up, done) == 0   # taken over: not one more
        up.unlink()
        done.set()   # mlx.launch ended: the one beat sent before it looked
        assert launch.beat_until_up(worker, up, done) == 1
    finally:
        done.set()
        beater.join(10)
        events.close()
        ctx.term()
        sockets.remove_runtime_dir(runtime)
