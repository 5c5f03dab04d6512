"""A worker group over MLX's ring backend on loopback: one model served by 2 and 3 real
rank processes (started by `python -m worker.group.launch` through `mlx.launch`), tensor
and pipeline sharded, against the same model in one process, through the real supervisor
and the official OpenAI client.

Timing: only the tests about silence shorten the heartbeat timeout (SHORT_HEARTBEAT:
24 beats a window, and room for a process's start on a loaded machine before its first);
a busy machine's slow start is injected (`slow_ranks`), never hoped for or against."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import nullcontext

import openai
import pytest

from bench.serverproc import still_running
from tests.serverproc import REPO, ServerProcess

pytestmark = pytest.mark.integration

PROMPTS = ["hello there", "tell me about the sea", "1 2 3 4"]
MAX_TOKENS = 16
SHORT_HEARTBEAT = ("--heartbeat-timeout", "6", "--heartbeat-interval", "0.25")


@pytest.fixture(scope="module")
def shard_model(models_dir):
    """6 heads, 6 layers: splits over 2 and 3 ranks by tensor and pipeline alike."""
    from worker.demos.text import build_model

    return str(build_model(models_dir / "tiny-shard", "tiny-shard").path)


def hostfile(tmp_path, ranks: int):
    path = tmp_path / f"hosts{ranks}.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(ranks)]}))
    return str(path)


def group_server(model, tmp_path, ranks, sharding, *extra, env=None):
    s = ServerProcess([model], "--hosts", hostfile(tmp_path, ranks), "--sharding", sharding,
                      *extra, env=env)
    s.wait_healthy(180)
    return s


def slow_ranks(tmp_path, ranks: set[str], delay: float) -> dict:
    """The environment that makes the ranks `ranks` (MLX_RANK) start `delay` s late, as
    their interpreters do on a loaded machine: a sitecustomize every process of the
    server runs at start (the others ignore it)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\n"
        f"if os.environ.get('MLX_RANK') in {sorted(ranks)!r}:\n"
        f"    time.sleep({delay})\n")
    return {"PYTHONPATH": f"{REPO}:{tmp_path}"}


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)


def complete(server, model, prompt, max_tokens=MAX_TOKENS):
    r = client(server).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


@pytest.fixture(scope="module")
def reference(shard_model):
    """The same model in one process: what every group must answer."""
    with ServerProcess([shard_model]) as s:
        s.wait_healthy(120)
        return {p: complete(s, shard_model, p) for p in PROMPTS}


def group_of(server) -> dict:
    _, body = server.get("/health")
    (worker,) = body["workers"]
    return worker


def rank_pids(server) -> list[int]:
    return [r["pid"] for r in group_of(server)["group"]["ranks"]]


# Three ranks once, by pipeline: a middle rank that both receives and sends is mlxd's own
# code (worker/group/p2p.py), and the group's broadcast and health run over 3 as over 2;
# tensor over 3 differs from tensor over 2 only inside mlx-lm's model.shard.
@pytest.mark.parametrize("ranks,sharding", [(2, "tensor"), (2, "pipeline"), (3, "pipeline")])
def test_group_answers_as_one_process(shard_model, reference, tmp_path, ranks, sharding,
                                      request):
    shared = (ranks, sharding) == (2, "tensor")  # the module's tensor2, left running
    with (nullcontext(request.getfixturevalue("tensor2")) if shared
          else group_server(shard_model, tmp_path, ranks, sharding)) as s:
        group = group_of(s)["group"]
        assert group["size"] == ranks and group["sharding"] == sharding
        assert group["backend"] == "ring"
        assert [r["rank"] for r in group["ranks"]] == list(range(ranks))
        assert len({r["pid"] for r in group["ranks"]}) == ranks
        assert all(r["active_bytes"] > 0 for r in group["ranks"])
        assert group["latency_s"] > 0 and group["bandwidth_bytes_s"] > 0
        for prompt in PROMPTS:
            assert complete(s, shard_model, prompt) == reference[prompt], prompt


@pytest.fixture(scope="module")
def tensor2(shard_model, tmp_path_factory):
    """One 2-rank tensor group for the module: the tests that keep its first epoch come
    first; those that kill a rank (and wait for the next epoch) come last."""
    with group_server(shard_model, tmp_path_factory.mktemp("g2"), 2, "tensor") as s:
        yield s


def test_concurrent_streams_each_get_their_solo_answer(shard_model, reference, tensor2):
    # (The epoch before, not 1: on a loaded machine the group's first start may time out
    # and the server respawn it before it is healthy; these tests ask that nothing in
    # them restarts it.)
    epoch = group_of(tensor2)["epoch"]
    prompts = PROMPTS + PROMPTS[:1]
    out: dict[int, tuple] = {}

    def run(i, prompt):
        out[i] = complete(tensor2, shard_model, prompt)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [out[i] for i in range(len(prompts))] == [reference[p] for p in prompts]
    assert group_of(tensor2)["epoch"] == epoch


def test_cancel_mid_stream_then_serve_again(shard_model, reference, tensor2):
    epoch = group_of(tensor2)["epoch"]
    stream = client(tensor2).chat.completions.create(
        model=shard_model, messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=2000, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
        if got >= 3:
            break
    stream.close()  # the supervisor cancels; the leader's rm reaches every rank
    deadline = time.monotonic() + 30
    while group_of(tensor2)["worker_active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_of(tensor2)["worker_active"] == 0
    assert complete(tensor2, shard_model, PROMPTS[0]) == reference[PROMPTS[0]]
    assert group_of(tensor2)["epoch"] == epoch  # the same group: nothing was restarted


def _settle(server, states=("ready", "broken"), timeout=120) -> dict:
    """The group once it is in one of `states` (a server not listening yet is in
    none)."""
    deadline, w = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            w = group_of(server)
        except OSError:
            w = {}
        if w.get("state") in states:
            return w
        time.sleep(0.2)
    raise AssertionError(f"not {' or '.join(states)}: {w}\n{server.log()}")


def _wait_epoch(server, epoch, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = group_of(server)
        if w["epoch"] >= epoch and w["state"] == "ready":
            return w
        time.sleep(0.2)
    raise AssertionError(f"no ready group of epoch {epoch}: {group_of(server)}\n{server.log()}")


def kill_mid_request(server, model, pid: int) -> list:
    """SIGKILL the rank `pid` while the group serves a long request; the request's errors
    (the client's APIStatusError, if it got one)."""
    errors = []

    def long_request():
        try:
            complete(server, model, PROMPTS[1], max_tokens=4000)
        except openai.APIStatusError as e:
            errors.append(e)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while not group_of(server)["worker_active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    return errors


def test_killed_rank_fails_clients_retryably_and_the_group_respawns(shard_model, reference,
                                                                   tensor2):
    s = tensor2
    before = group_of(s)
    follower = rank_pids(s)[1]
    errors = kill_mid_request(s, shard_model, follower)
    assert len(errors) == 1 and errors[0].status_code == 503, errors
    assert errors[0].response.headers.get("retry-after")
    w = _wait_epoch(s, before["epoch"] + 1)
    assert w["restart_causes"].get("crash", 0) == before["restart_causes"].get(
        "crash", 0) + 1, w
    # The leader left with the group's own code (by its step failing, or by
    # mlx.launch's SIGTERM), which the launcher passed on.
    assert "lost a rank" in (w["last_error"] or ""), w
    assert follower not in rank_pids(s)
    assert complete(s, shard_model, PROMPTS[2]) == reference[PROMPTS[2]]


def test_a_leader_blocked_in_a_collective_still_leaves_as_lost(shard_model, reference,
                                                              tmp_path):
    """The leader's main thread inside MLX's C++ when a rank dies, where no Python signal
    handler runs: a ring collective whose peer died never returns once that socket's
    thread has failed (worker/faults.py: the leader's failed step runs the lost group's
    collectives on, as when more of the step's were queued behind the one that failed).
    mlx.launch's SIGTERM must still end it with the group's code at once: a crash that
    says it lost a rank, not a kill for the dead rank's silence a heartbeat timeout later,
    and no rank process left behind."""
    import psutil

    with group_server(shard_model, tmp_path, 2, "tensor",
                      env={"MLXD_TEST_FAULTS": "hang_on_group_lost=1"}) as s:
        # The fault runs only if the leader's step fails before mlx.launch's SIGTERM
        # comes (on a busy machine the launcher can be first: then the leader leaves as
        # lost without being blocked, which the other kill test covers): up to three
        # kills, each checked as a crash, until one blocked the leader.
        for attempt in range(3):
            before, seen = group_of(s), len(s.log(tail=None))
            ranks = [psutil.Process(pid) for pid in rank_pids(s)]
            errors = kill_mid_request(s, shard_model, ranks[1].pid)
            assert len(errors) == 1 and errors[0].status_code == 503, errors
            w = _wait_epoch(s, before["epoch"] + 1)
            log = s.log(tail=None)[seen:]
            causes = {c: n - before["restart_causes"].get(c, 0)
                      for c, n in w["restart_causes"].items()}
            assert {c: n for c, n in causes.items() if n} == {"crash": 1}, (w, log[-3000:])
            assert "lost a rank" in (w["last_error"] or ""), w
            assert still_running(ranks) == []
            if "the leader runs the lost group's collectives on" in log:  # the fault ran
                break
        else:
            raise AssertionError("the leader's step never failed before the launcher's "
                                 "SIGTERM in three kills: the fault never ran")
        assert "no collective of the lost group blocked" not in log      # and blocked
        assert complete(s, shard_model, PROMPTS[2]) == reference[PROMPTS[2]]


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
        assert (w["state"], w["epoch"], w["restarts"]) == ("ready", 1, 0), (w, s.log())
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


def test_a_sigterm_to_the_leader_ends_the_group_as_lost(shard_model, reference, tensor2):
    """mlx.launch SIGTERMs the other ranks when one fails: the leader must leave with the
    group's own code (its clients retry), not die unexplained or drain as cancelled."""
    s = tensor2
    # A ready group, its ranks those of that epoch: on a busy machine an earlier test's
    # respawn (or a start that timed out) may still be under way, and a SIGTERM to a rank
    # that is leaving or loading is not the case here. (Three CI runs failed here with the
    # epoch gone as "exited with code 1": the leader's two SIGTERM handlers both wrote the
    # exit file, and the first's exit cut the second's write short, worker/group/rank.py.)
    w0 = _wait_epoch(s, group_of(s)["epoch"])
    epoch, leader = w0["epoch"], w0["group"]["ranks"][0]["pid"]
    log = s.log(tail=None)  # (all of it: a tail's window moves on as the respawn logs)
    lost_before = log.count("lost a rank")
    os.kill(leader, signal.SIGTERM)
    # The exit is logged with its cause, before the respawn it starts is ready; waited for,
    # not read at the next ready epoch, which another restart could bring first. last_error
    # alone can't be asked: on this shared group a respawn may fail to load once more (its
    # last ranks still leaving) before one is ready, and that later error replaces the
    # exit's.
    deadline = time.monotonic() + 120
    while s.log(tail=None).count("lost a rank") <= lost_before and time.monotonic() < deadline:
        time.sleep(0.2)
    w = _wait_epoch(s, epoch + 1)
    since = s.log(tail=None)[len(log):]
    gone = [line for line in since.splitlines() if " gone: " in line or "killing" in line]
    assert "lost a rank" in since, (w, gone)  # (the lines that say how each epoch ended)
    assert complete(s, shard_model, PROMPTS[0]) == reference[PROMPTS[0]]
