"""The group's control channel: the leader's operations to every follower, and the
followers' heartbeats back, over ZeroMQ between mlxd's own processes.

Why not MLX's collectives, which carry every tensor: a collective waits for every rank,
so a follower waiting for the next step's operations would sit inside one between
requests, and MLX's ring backend spins a core while it waits; and a control collective
must run on the model's stream (or the ranks may pair it with another rank's layer sum),
behind the step in flight, so no rank could prepare a step while the last one computes.
Over ZeroMQ the leader sends and goes on; a follower blocks in a plain `recv` (no CPU)
and starts a step as soon as it knows it; the step's own collectives keep every rank in
lockstep.

Both sockets are CURVE-authenticated and encrypted (keys.py): the leader accepts only
followers holding the group's rank key, and followers only a leader holding its key.

- Leader: a ROUTER bound to the endpoint the launcher chose (the hostfile's first host,
  never every interface) sends each message to every follower (each said hello, so
  every send has a peer); a PULL beside it takes the followers' heartbeats, read by a
  thread, so `silence()` says how long the stalest follower has been quiet (a rank that
  hangs; the supervisor kills the group on it: supervisor/workers/liveness.py).
- Follower: a DEALER (identity: its rank) that receives, and a PUSH a thread beats on;
  each beat carries the rank's MLX memory as its MLX thread last published it
  (`memory`), so `mlxctl status` shows every rank's memory live.
"""

from __future__ import annotations

import logging
import struct
import threading
import time

import zmq

log = logging.getLogger("worker.group.control")

BEAT_EVERY = 0.5     # s between a follower's heartbeats
HELLO_WAIT = 120.0   # s a follower's hello may wait for a connection to the leader
_POLL_MS = 200
_BEAT = struct.Struct("<IQQ")   # rank, MLX active bytes, MLX peak bytes


def endpoints(control: str) -> tuple[str, str]:
    """tcp://HOST:PORT → (the operations' endpoint, the heartbeats': PORT + 1)."""
    head, _, port = control.rpartition(":")
    return control, f"{head}:{int(port) + 1}"


def _server(sock: zmq.Socket, keys) -> zmq.Socket:
    sock.curve_secretkey = keys.leader_secret
    sock.curve_publickey = keys.leader_public
    sock.curve_server = True
    return sock


def _client(sock: zmq.Socket, keys) -> zmq.Socket:
    sock.curve_secretkey = keys.rank_secret
    sock.curve_publickey = keys.rank_public
    sock.curve_serverkey = keys.leader_public
    return sock


class LeaderControl:
    def __init__(self, ctx: zmq.Context, control: str, followers: int, keys,
                 clock=time.monotonic):
        from zmq.auth.thread import ThreadAuthenticator

        ops, beats = endpoints(control)
        self._clock = clock
        # ZAP: a connection is accepted only with a client key found in keys.clients.
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(keys.clients))
        self.router = _server(ctx.socket(zmq.ROUTER), keys)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(ops)
        self._beats = _server(ctx.socket(zmq.PULL), keys)
        self._beats.setsockopt(zmq.LINGER, 0)
        self._beats.bind(beats)
        self.followers = followers
        self.peers: list[bytes] = []
        self.seen: dict[int, float] = {}
        self.memory: dict[int, tuple[int, int]] = {}   # rank → (active, peak) bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="group-beats", daemon=True)

    def wait_hellos(self, timeout: float) -> None:
        """Every follower's hello (they connect as they start): then every send has a
        peer to go to."""
        deadline = self._clock() + timeout
        while len(self.peers) < self.followers:
            left = deadline - self._clock()
            if left <= 0 or not self.router.poll(int(left * 1000)):
                raise RuntimeError(f"{self.followers - len(self.peers)} rank(s) of the group "
                                   "did not reach the leader's control channel")
            peer, _ = self.router.recv_multipart()
            if peer not in self.peers:
                self.peers.append(peer)
        now = self._clock()
        self.seen = {int(p.decode().lstrip("r")): now for p in self.peers}
        self._thread.start()

    def send(self, message: bytes) -> None:
        for peer in self.peers:
            try:
                self.router.send_multipart([peer, message], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # EHOSTUNREACH: that rank's connection is gone
                raise ConnectionError(f"rank {peer.decode()} is unreachable: {e}") from None

    def silence(self) -> float | None:
        """Seconds since the stalest follower's last heartbeat (None before the group
        is up)."""
        if not self.seen:
            return None
        return max(0.0, self._clock() - min(self.seen.values()))

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                if self._beats.poll(_POLL_MS):
                    rank, active, peak = _BEAT.unpack(self._beats.recv())
                    self.seen[rank] = self._clock()
                    if active:  # 0: not published yet (a rank still loading), not "empty"
                        self.memory[rank] = (active, peak)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        self.router.close()
        self._beats.close()
        self.auth.stop()


class FollowerControl:
    def __init__(self, ctx: zmq.Context, control: str, rank: int, keys,
                 hello_wait: float = HELLO_WAIT):
        ops, beats = endpoints(control)
        self.dealer = _client(ctx.socket(zmq.DEALER), keys)
        self.dealer.setsockopt(zmq.IDENTITY, f"r{rank}".encode())
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(ops)
        # A DEALER's send waits for a connection; one the leader refused (a wrong key)
        # is not retried, so without a bound the rank would hang here, not fail.
        self.dealer.setsockopt(zmq.SNDTIMEO, int(hello_wait * 1000))
        try:
            self.dealer.send(b"hello")
        except zmq.Again:
            self.dealer.close()
            raise RuntimeError(f"rank {rank} could not reach the leader's control channel "
                               f"in {hello_wait:g} s (a wrong group key, or no leader)") from None
        self.dealer.setsockopt(zmq.SNDTIMEO, -1)
        self._push = _client(ctx.socket(zmq.PUSH), keys)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 4)   # beats are worth nothing once stale
        self._push.connect(beats)
        self._rank = rank
        self.memory = (0, 0)   # (active, peak): set by the MLX thread, read by the beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="group-beat", daemon=True)
        self._thread.start()

    def receive(self) -> bytes:
        return self.dealer.recv()

    def _beat(self) -> None:
        try:
            while not self._stop.wait(BEAT_EVERY):
                try:
                    self._push.send(_BEAT.pack(self._rank, *self.memory), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.dealer.close()
        self._push.close()
