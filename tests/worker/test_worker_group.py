"""The worker group's parts without processes: the follower's replay and its divergence
checks, the leader's record, the broadcast's framing, the sharding choice, the seed every
rank shares, and each rank's device (the control channel: test_group_control.py; the
launcher: test_group_launch.py)."""

from __future__ import annotations

import json
import os

import msgpack
import pytest

from protocol.codec import encode
from protocol.messages import Generate, SamplingParams, pack_ids
from worker.text import sampling
from worker.text.engine import Prepared
from worker.group import launch, setup
from worker.group.broadcast import FRAME, Broadcast
from worker.group.follower import Diverged, Follower
from worker.group.leader import PING_EVERY, GroupLost, LeaderBatch, checksum
from worker.errors import LoadError


def gen(rid: str, ids=(1, 2, 3)) -> Generate:
    return Generate(rid=rid, prompt_ids=pack_ids(list(ids)), sampling=SamplingParams(max_tokens=4))


class Chunks:
    def __init__(self, size=512):
        self.size = size


class FakeBatch:
    """Records what the follower or the leader does to it; `step` emits `tokens`."""

    def __init__(self, cached=0):
        self.calls: list = []
        self.members: dict[int, object] = {}
        self.kvcache = None
        self.chunks = Chunks()
        self.cached = cached
        self.tokens = 7
        self.fail_next = False
        self._uid = 0

    def add(self, seq, prep):
        seq.uid = self._uid
        self.members[self._uid] = seq
        self._uid += 1
        self.calls.append(("add", seq.rid, list(prep.ids)))
        return self.cached

    def remove(self, seq):
        self.members.pop(seq.uid, None)
        self.calls.append(("rm", seq.rid))

    def _set_chunk(self, size):
        self.calls.append(("chunk", size))

    def step(self):
        self.calls.append(("step",))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("step failed")
        return [(seq, (self.tokens, "x", None, None)) for seq in self.members.values()]

    def reset(self):
        self.calls.append(("reset",))
        seqs = list(self.members.values())
        self.members.clear()
        return seqs

    def close(self):
        self.calls.append(("close",))

    def fits(self, prep):
        return True


class FakeEngine:
    def __init__(self):
        self.recovered = 0

    def prepare(self, g):
        return Prepared(g, list(range(5)))

    def recover(self):
        self.recovered += 1


class Queue:
    """A control channel in memory: what a leader sends, a follower receives."""

    def __init__(self):
        self.sent: list[bytes] = []
        self.fail = False

    def send(self, message):
        if self.fail:
            raise ConnectionError("rank r1 is unreachable")
        self.sent.append(message)

    def ops(self, i=-1):
        return msgpack.unpackb(self.sent[i], raw=False)


# ---- leader -----------------------------------------------------------------------

def test_leader_sends_what_changed_with_each_step():
    inner, q = FakeBatch(cached=2), Queue()
    leader = LeaderBatch(inner, q)

    class Seq:
        rid, uid = "a", None

    seq = Seq()
    assert leader.add(seq, Prepared(gen("a"), [1, 2, 3])) == 2
    assert q.sent == []  # adding runs no forward pass: nothing sent yet
    inner.chunks.size = 1024
    results = leader.step()
    ops = q.ops()
    assert [op[0] for op in ops] == ["add", "step"]
    assert ops[0][2] == 2 and ops[1][1:] == [1024, None]
    assert leader.step() and q.ops()[-1] == ["step", 1024, checksum(results)]
    leader.remove(seq)
    leader.remove(seq)  # already gone: recorded once
    leader.idle()
    assert q.ops() == [["rm", "a"], ["ping"]]


def test_leader_pings_when_idle_and_turns_a_lost_rank_into_group_lost():
    now = [0.0]
    q = Queue()
    leader = LeaderBatch(FakeBatch(), q, clock=lambda: now[0])
    leader.idle()
    assert q.sent == []
    now[0] += PING_EVERY
    leader.idle()
    assert q.ops() == [["ping"]]
    q.fail = True
    with pytest.raises(GroupLost):
        leader.step()
    leader.close()  # a rank already gone: closing still closes this rank's batch
    assert leader.inner.calls[-1] == ("close",)


def test_a_lost_group_closes_without_touching_its_batch():
    """Its MLX streams may wait forever on a failed step's collectives (closing the
    batch would wait with them): the followers are told to stop, and that is all."""
    q = Queue()
    batch = FakeBatch()
    LeaderBatch(batch, q).close(lost=True)
    assert q.ops() == [["stop"]] and ("close",) not in batch.calls


def test_leader_reset_drops_the_record_and_tells_every_rank():
    inner, q = FakeBatch(), Queue()
    leader = LeaderBatch(inner, q)

    class Seq:
        rid, uid = "a", None

    leader.add(Seq(), Prepared(gen("a"), [1]))
    leader.reset()
    assert q.ops() == [["reset"]]


# ---- follower ---------------------------------------------------------------------

def follower(cached=0):
    batch, engine = FakeBatch(cached), FakeEngine()
    return Follower(engine, batch, control=None), batch, engine


def test_follower_replays_adds_steps_and_removals():
    f, batch, _ = follower()
    assert f.apply(["add", encode(gen("a")), 0])
    f.apply(["step", 2048, None])
    assert batch.calls == [("add", "a", [0, 1, 2, 3, 4]), ("chunk", 2048), ("step",)]
    assert batch.chunks.size == 2048
    expected = checksum([(f.seqs["a"], (7, "", None, None))])
    f.apply(["step", 2048, expected])   # the leader's tokens agree
    f.apply(["rm", "a"])
    f.apply(["rm", "a"])  # idempotent
    assert ("rm", "a") in batch.calls and "a" not in f.seqs
    assert f.apply(["stop"]) is False and batch.calls[-1] == ("close",)


def test_follower_refuses_to_diverge():
    f, batch, _ = follower(cached=3)
    with pytest.raises(Diverged, match="cached"):
        f.apply(["add", encode(gen("a")), 0])
    f, batch, _ = follower()
    f.apply(["add", encode(gen("a")), 0])
    f.apply(["step", 512, None])
    with pytest.raises(Diverged, match="tokens differ"):
        f.apply(["step", 512, 12345])
    with pytest.raises(Diverged, match="unknown"):
        follower()[0].apply(["teleport"])


def test_follower_failed_step_must_be_followed_by_the_leaders_reset():
    f, batch, engine = follower()
    f.apply(["add", encode(gen("a")), 0])
    batch.fail_next = True
    f.apply(["step", 512, None])
    f.apply(["reset"])   # the leader's step failed too: every rank starts over
    assert engine.recovered == 1 and not f.seqs and not f.failed
    f.apply(["add", encode(gen("b")), 0])
    batch.fail_next = True
    f.apply(["step", 512, None])
    with pytest.raises(Diverged, match="not on the leader"):
        f.apply(["step", 512, None])


# ---- broadcast framing ------------------------------------------------------------

class Group:
    def __init__(self, rank, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_broadcast_frames_a_long_message_in_two_collectives():
    import numpy as np

    sizes, frames = [], []

    def leader_sum(a):
        sizes.append(a.size)
        frames.append(np.asarray(a).tobytes())
        return a

    message = bytes(range(256)) * 40   # longer than one frame
    assert Broadcast(Group(0), all_sum=leader_sum).exchange(message) == message
    assert sizes == [FRAME, len(message) - (FRAME - 4)]
    replay = iter(frames)   # what a follower's all-sums return: the leader's bytes

    def follower_sum(a):
        import mlx.core as mx

        data = next(replay)
        assert a.size == len(data)
        return mx.array(np.frombuffer(data, dtype=np.uint8))

    assert Broadcast(Group(1), all_sum=follower_sum).exchange(None) == message


# ---- sharding, launcher, seed -----------------------------------------------------

class Model:
    def __init__(self, tensor=True, pipeline=True):
        if tensor:
            self.shard = lambda group: None
        if pipeline:
            self.model = type("Inner", (), {"pipeline": lambda self, g: None})()


def test_sharding_choice():
    cfg = {"num_hidden_layers": 6, "num_key_value_heads": 6, "model_type": "qwen2"}
    assert setup._sharding(Model(), cfg, 2, "auto") == "tensor"
    assert setup._sharding(Model(), cfg, 3, "pipeline") == "pipeline"
    assert setup._sharding(Model(tensor=False), cfg, 2, "auto") == "pipeline"
    odd = {**cfg, "num_key_value_heads": 3}
    assert setup._sharding(Model(), odd, 2, "auto") == "pipeline"
    with pytest.raises(LoadError, match="3 key/value heads"):
        setup._sharding(Model(), odd, 2, "tensor")
    # auto prefers pipeline on a CUDA GPU and falls back to tensor where pipeline is out.
    assert setup._sharding(Model(), cfg, 2, "auto", prefer="pipeline") == "pipeline"
    assert setup._sharding(Model(pipeline=False), cfg, 2, "auto", prefer="pipeline") == "tensor"
    wide = {**cfg, "num_key_value_heads": 8}  # 8 heads split over 8 ranks; 6 layers do not
    assert setup._sharding(Model(), wide, 8, "auto", prefer="pipeline") == "tensor"
    assert setup.preferred() == "tensor"  # this machine: MLX's CPU backend
    with pytest.raises(LoadError, match="fewer than 8 ranks"):
        setup._sharding(Model(tensor=False), cfg, 8, "auto")
    with pytest.raises(LoadError, match="no tensor parallel"):
        setup._sharding(Model(tensor=False), cfg, 2, "tensor")
    # A model without pipeline sharding (mlx-lm's llama: SmolLM2, 3 KV heads) asked for
    # it is refused for that, not for its heads (which only tensor sharding splits).
    with pytest.raises(LoadError, match="no pipeline parallel sharding$"):
        setup._sharding(Model(pipeline=False), odd, 2, "pipeline")


PIPELINE_RANK = """
import sys
import mlx.core as mx
from mlx_lm.models import qwen2
from mlx_lm.models.cache import make_prompt_cache
from worker.group import setup
group = mx.distributed.init()
mx.random.seed(0)
model = qwen2.Model(qwen2.ModelArgs(
    model_type="qwen2", hidden_size=48, num_hidden_layers=6, intermediate_size=96,
    num_attention_heads=6, num_key_value_heads=6, rms_norm_eps=1e-5, vocab_size=128))
mx.eval(model.parameters())

def run():  # a prefill, then a decode step on its cache, each evaluated as the batch does
    cache = make_prompt_cache(model)
    a = model(mx.array([[3, 14, 15, 92, 65, 35, 89, 79]]), cache=cache)
    mx.eval(a)
    b = model(mx.array([[7]]), cache=cache)
    mx.eval(b)
    return mx.concatenate([a, b], axis=1)

whole = run()
native = setup.native_p2p()
if not native:
    from worker.group import p2p
    p2p.install()
model.model.pipeline(group)
# (one write a line: the launcher passes the ranks' output on as it comes, and print's
# pieces, unbuffered, interleave with another rank's)
sys.stdout.write(f"rank {group.rank()} {native} {float(mx.abs(run() - whole).max())}\\n")
sys.stdout.flush()
"""


def test_pipeline_transfers_ride_on_all_reduces_where_there_is_no_send_recv(tmp_path):
    """MLX's CUDA backend has no send/recv (issue 36): mlx-lm's pipeline runs with its
    transfers carried by all-reduces (worker/group/p2p.py), here forced on three CPU ranks
    of a real mlx.launch ring job: every rank's output of a prefill and a decode step is
    the whole model's."""
    import subprocess
    import sys

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3}))
    root = launch.__file__.rsplit("/worker/", 1)[0]
    env = {**os.environ, setup.P2P_ENV: "collectives",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; "
                               "sys.exit(main())", "--hostfile", str(hosts), "--backend",
         "ring", "--starting-port", str(launch.free_ports(3)), "--",
         sys.executable, "-c", PIPELINE_RANK],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, cwd=root,
        env=env)
    lines = sorted(line.split() for line in out.stdout.splitlines() if line.startswith("rank"))
    assert [line[:3] for line in lines] == [["rank", str(r), "False"] for r in range(3)], \
        out.stdout + out.stderr
    assert all(float(line[3]) < 1e-5 for line in lines), lines


def test_reseeding_follows_the_shared_seed():
    """Ranks whose sources share a seed reseed alike, reseed after reseed."""
    import random

    import mlx.core as mx

    def draws(seed):
        rng = random.Random(seed)
        sampling.use_seed_source(lambda: rng.getrandbits(64))
        out = []
        for _ in range(2):
            sampling.reseed()
            out.append(mx.random.uniform(shape=(4,)).tolist())
        return out

    try:
        first, second = draws(5), draws(5)
        assert first == second and first[0] != first[1] and draws(6) != first
    finally:
        sampling.use_seed_source(sampling._os_seed)


def test_a_failed_collective_ends_the_group_not_the_requests():
    """The backend's own wording of a lost peer makes the step raise GroupLost (the
    scheduler lets it through); any other failure stays the scheduler's to isolate."""
    from worker.errors import WorkerBroken

    inner, q = FakeBatch(), Queue()
    leader = LeaderBatch(inner, q)

    def lost():
        raise RuntimeError("[ring] connection to a peer was lost")

    inner.step = lost
    with pytest.raises(GroupLost) as err:
        leader.step()
    assert isinstance(err.value, WorkerBroken)
    inner.step = lambda: (_ for _ in ()).throw(RuntimeError("some kernel failed"))
    with pytest.raises(RuntimeError, match="kernel"):
        leader.step()


@pytest.mark.parametrize("hosts,visible,devices", [
    # two GPUs of this machine, however its entries name it
    ([{"ssh": "127.0.0.1"}, {"ssh": "localhost"}], None, ["0", "1"]),
    # interleaved hosts: each host's ranks count from its own first GPU
    ([{"ssh": "127.0.0.1"}, {"ssh": "b"}, {"ssh": "127.0.0.1"}, {"ssh": "b"}], None,
     ["0", "0", "1", "1"]),
    # this machine's CUDA_VISIBLE_DEVICES is what its places index; other hosts' are theirs
    ([{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.1"}, {"ssh": "b"}], "4, 6", ["4", "6", "0"]),
    ([{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.1"}], "3", ["3", "1"]),
])
def test_each_rank_gets_its_own_gpu_by_its_place_on_its_host(hosts, visible, devices):
    from protocol.hosts import rank_devices

    assert rank_devices(hosts, visible) == devices


def test_the_ranks_of_a_real_mlx_launch_see_their_own_gpu(tmp_path, monkeypatch):
    """mlx.launch (nccl) gives every rank of a hostfile CUDA_VISIBLE_DEVICES=0, after the
    launcher's --env values: each rank corrects it before MLX is imported. Run on the CPU
    with the real mlx.launch, each rank printing what it saw and what it set; on 2-GPU
    hosts all ranks on GPU 0 made NCCL fail with 'invalid usage' (issue 36)."""
    import subprocess
    import sys

    from protocol.hosts import read_hostfile

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "nccl", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3}))
    rank = ("import os; from worker.group.rank import pin_device; "
            "seen = os.environ.get('CUDA_VISIBLE_DEVICES'); pin_device(); "
            "import sys; sys.stdout.write(f\"rank {os.environ['MLX_RANK']} {seen} "
            "{os.environ['CUDA_VISIBLE_DEVICES']}\\n\")")  # (one write: see PIPELINE_RANK)
    cmd = launch.launch_command(hostfile, read_hostfile(hostfile), str(tmp_path / "exit"),
                                [sys.executable, "-c", rank], tmp_path / "keys")
    assert "MLXD_GROUP_DEVICES=0,1,2" in cmd
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, cwd=launch.__file__.rsplit("/worker/", 1)[0])
    lines = sorted(line.split() for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == [["rank", "0", "0", "0"], ["rank", "1", "0", "1"], ["rank", "2", "0", "2"]], \
        out.stdout + out.stderr
    ring = {"backend": "ring", "hosts": [{"ssh": "127.0.0.1"}] * 2}  # ranks may share one
    assert not any(a.startswith("MLXD_GROUP_DEVICES") for a in launch.launch_command(
        hostfile, ring, "/x/exit", ["w"], tmp_path / "keys"))
