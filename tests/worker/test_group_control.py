"""A worker group's control channel over real ZeroMQ sockets (worker/group/control.py):
operations and heartbeats both ways, a rank that never connects, a wrong key and plain
text refused; and the group's keys, made once and kept private (worker/group/keys.py)."""

from __future__ import annotations

import time

import pytest
import zmq

from worker.group import keys, launch
from worker.group.control import FollowerControl, LeaderControl


@pytest.fixture
def group_keys(tmp_path):
    return keys.load(keys.ensure(tmp_path / "state"))


def test_group_keys_are_made_once_and_kept_private(tmp_path):
    folder = keys.ensure(tmp_path / "state")
    assert keys.ensure(tmp_path / "state") == folder
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in folder.glob("*.key_secret")} == {0o600}
    loaded = keys.load(folder)
    assert loaded.leader_public != loaded.rank_public and loaded.rank_secret
    with pytest.raises(ValueError, match="copy"):
        keys.load(tmp_path / "elsewhere")


def until(done, timeout=30.0) -> bool:
    """Polls `done` until it holds (True) or `timeout` real seconds pass (False): the
    beats' threads run when a loaded machine lets them."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_control_channel_carries_operations_and_heartbeats(group_keys):
    ctx = zmq.Context()
    port = launch.free_ports(2)
    endpoint = f"tcp://127.0.0.1:{port}"
    now = [100.0]   # the leader's clock: silence is measured on it
    leader = LeaderControl(ctx, endpoint, followers=2, keys=group_keys, clock=lambda: now[0])
    followers = [FollowerControl(ctx, endpoint, r, group_keys) for r in (1, 2)]
    try:
        leader.wait_hellos(10)
        assert sorted(leader.peers) == [b"r1", b"r2"]
        leader.send(b"ops")
        assert [f.receive() for f in followers] == [b"ops", b"ops"]
        followers[0].memory = (5 << 20, 7 << 20)   # what its MLX thread last published
        now[0] = 200.0
        assert leader.silence() == 100.0
        assert until(lambda: leader.silence() == 0.0)   # both beat since
        # Rank 2 published nothing yet: no figure, rather than a zero that would hide
        # what its Ready said.
        assert until(lambda: leader.memory == {1: (5 << 20, 7 << 20)})
        followers[1].close()            # one rank goes quiet; rank 1 beats on
        for t in (250.0, 300.0):   # (a beat rank 2 sent before it closed lands by 250)
            now[0] = t
            assert until(lambda: leader.seen[1] == t)
        assert leader.seen[2] <= 250.0 and leader.silence() >= 50.0
    finally:
        followers[0].close()
        leader.close()
        ctx.term()


def test_control_channel_gives_up_on_a_rank_that_never_connects(group_keys):
    ctx = zmq.Context()
    leader = LeaderControl(ctx, f"tcp://127.0.0.1:{launch.free_ports(2)}", followers=1,
                           keys=group_keys)
    try:
        with pytest.raises(RuntimeError, match="did not reach"):
            leader.wait_hellos(0.3)
    finally:
        leader.close()
        ctx.term()


def test_control_channel_refuses_a_wrong_key_and_plain_text(group_keys, tmp_path):
    """A follower with another group's keys, or none, never reaches the leader."""
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{launch.free_ports(2)}"
    leader = LeaderControl(ctx, endpoint, followers=1, keys=group_keys)
    other = keys.load(keys.ensure(tmp_path / "other"))
    # Another group's rank key, but this leader's public key: the leader's ZAP refuses it.
    # Its hello is queued, or (where the refusal came first, on a busy machine) it
    # fails to send: either way it must not hang, and must not get in.
    try:
        impostor = FollowerControl(ctx, endpoint, 1, keys.Keys(
            other.folder, group_keys.leader_public, None, other.rank_public,
            other.rank_secret), hello_wait=3)
    except RuntimeError as e:
        assert "could not reach the leader" in str(e)
        impostor = None
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.IDENTITY, b"r1")
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(endpoint)
    plain.send(b"hello")
    try:
        with pytest.raises(RuntimeError, match="did not reach"):
            leader.wait_hellos(1.5)
        assert leader.peers == []
        honest = FollowerControl(ctx, endpoint, 1, group_keys)
        leader.wait_hellos(5)   # the right key still gets in
        assert leader.peers == [b"r1"]
        honest.close()
    finally:
        plain.close()
        if impostor is not None:
            impostor.close()
        leader.close()
        ctx.term()
