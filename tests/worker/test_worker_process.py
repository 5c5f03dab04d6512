"""The real `python -m worker` over real ZMQ, the test playing the supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from protocol import (Cancel, Done, FinishReason, Generate, Shutdown, StatusRequest, sockets,
                      unpack_ids)
from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INTERNAL, LOAD_FAILED

from tests.generates import generate
from tests.worker.harness import REPO, WorkerProc

LONG = 3000  # max_tokens of a request that runs for seconds, until the test cancels it


def long_gen(rid: str, prompt: str = "Hello") -> Generate:
    """A request that streams until cancelled: greedy, so it cannot sample EOS early
    (the tiny model's greedy output for these prompts has no EOS in 3000 tokens)."""
    return generate(rid=rid, prompt=prompt, max_tokens=LONG, temperature=0.0)


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    """One worker for the tests that leave it serving (each consumes its own events).
    One sequence at a time, so a second request waits (batching: test_worker_batching).
    Admitted at its weights alone (memory factor 1): nothing left for MLX's buffer cache
    beyond what `cache_limit` keeps for a decode step."""
    w = WorkerProc(tiny_model, tmp_path_factory.mktemp("state"), "--name", "tiny-test",
                   "--heartbeat-interval", "0.2", "--max-batch-size", "1",
                   "--memory-factor", "1", epoch=5)
    w.ready, w.before_ready = w.wait_for("ready", timeout=60)
    yield w
    w.close()


def test_mlxs_buffer_cache_keeps_a_decode_steps_buffers(worker, tiny_loaded):
    """worker/loading/startup.py `cache_limit`: admitted at its weights and KV budget, the
    worker has no leftover for the cache, and a cache limit of 0 handed every freed
    buffer back to the system each token; the limit it sets holds at least what one
    decode step (of its one row) frees."""
    import re

    from worker.loop.sizing import StepMemory

    found = re.search(r"MLX buffer cache limited to .* \((\d+) bytes\)",
                      worker.stderr_text())
    assert found, worker.stderr_text()
    assert int(found.group(1)) >= StepMemory.freed(tiny_loaded.model, 1) > 0


def deltas_of(events):
    return [e for e in events if e.kind == "delta"]


def test_ready_describes_the_model(worker, tiny_model):
    r = worker.ready
    assert (r.model, r.context_length, r.slots, r.random_weights) == ("tiny-test", 4096, 1, True)
    assert r.pid == worker.proc.pid
    assert r.active_bytes > 0 and r.peak_bytes >= r.active_bytes
    assert not worker.before_ready  # only heartbeats (set aside) may precede Ready
    assert worker.heartbeats and worker.heartbeats[0].state == "loading"


@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_generate_streams_started_deltas_and_one_done(worker, kind):
    body = ({"prompt": "Tell me a story"} if kind == "prompt"
            else {"messages": [{"role": "user", "content": "Tell me a story"}]})
    worker.send(generate(rid=f"g-{kind}", max_tokens=25, temperature=0.0, **body))
    events = worker.collect(f"g-{kind}")
    assert events[0].kind == "started" and events[0].prompt_tokens > 0
    assert [e.kind for e in events[1:-1]] == ["delta"] * (len(events) - 2)
    done = events[-1]
    tokens = [t for d in deltas_of(events) for t in unpack_ids(d.token_ids)]
    assert done.finish_reason in ("length", "stop")
    assert done.completion_tokens == len(tokens) == len(deltas_of(events))
    assert done.prompt_tokens == events[0].prompt_tokens
    if done.finish_reason == "length":
        assert len(tokens) == 25
    # Greedy is deterministic across requests: the same tokens again.
    worker.send(generate(rid=f"g-{kind}-2", max_tokens=25, temperature=0.0, **body))
    again = worker.collect(f"g-{kind}-2")
    assert [unpack_ids(d.token_ids) for d in deltas_of(again)] == \
        [unpack_ids(d.token_ids) for d in deltas_of(events)]


def test_cancel_mid_stream_ends_promptly(worker):
    worker.send(long_gen("c1", "Count to ten"))
    seen = 0
    while seen < 5:
        seen += worker.recv().kind == "delta"
    worker.send(Cancel(rid="c1"))
    t0 = time.monotonic()
    rest = worker.collect("c1")
    took = time.monotonic() - t0
    done = rest[-1]
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens == seen + len(deltas_of(rest))
    # Dropped within a handful of steps (what was already on its way, at ~1 ms a step).
    assert len(deltas_of(rest)) < 100, len(deltas_of(rest))
    assert took < 1.0
    worker.send(Cancel(rid="c1"))  # idempotent: no second Done (checked by the next test)


def test_waiting_request_cancelled_without_started(worker):
    worker.send(long_gen("q-active", "Hello"))
    worker.send(generate(rid="q-waiting", prompt="Hello", max_tokens=10))
    worker.wait_for("delta", rid="q-active")
    worker.send(Cancel(rid="q-waiting"))
    done, skipped = worker.wait_for("done", rid="q-waiting")
    assert done.finish_reason == "cancelled" and done.completion_tokens == 0
    assert all(e.rid in ("q-active",) for e in skipped if hasattr(e, "rid"))
    # Answered while the active one was still streaming, which then gets cancelled too.
    worker.send(Cancel(rid="q-active"))
    events = worker.collect("q-active")
    assert events[-1].finish_reason == "cancelled"
    assert not [e for e in events if getattr(e, "rid", None) == "c1"]


def test_status_answered_while_busy(worker):
    worker.send(long_gen("s1", "Hello"))
    worker.wait_for("delta", rid="s1")
    t0 = time.monotonic()
    worker.send(StatusRequest(qid=42))
    status, _ = worker.wait_for("status")
    assert time.monotonic() - t0 < 0.5
    assert (status.qid, status.state, status.active, status.waiting) == (42, "busy", ["s1"], [])
    assert status.steps > 0 and status.active_bytes > 0
    worker.send(Cancel(rid="s1"))
    worker.collect("s1")


def test_heartbeats_flow_while_streaming(worker):
    worker.send(long_gen("h1", "Hello"))
    worker.wait_for("delta", rid="h1")
    # Until three beats and 50 deltas have come (about a second; longer on a busy machine).
    beats, deltas, deadline = [], 0, time.monotonic() + 30
    while (len(beats) < 3 or deltas <= 50) and time.monotonic() < deadline:
        e = worker.recv(heartbeats=True)
        assert e.kind != "done", "h1 ended before the test cancelled it"
        if e.kind == "heartbeat":
            beats.append(e)
        deltas += e.kind == "delta"
    worker.send(Cancel(rid="h1"))
    worker.collect("h1")
    assert deltas > 50  # events were flowing all along
    assert len(beats) >= 3  # every 0.2 s
    assert all(b.state == "busy" and b.active == 1 for b in beats)
    assert beats[-1].steps > beats[0].steps


def test_garbage_commands_do_not_kill_it(worker):
    import msgpack

    for junk in (b"", b"\x00\xffgarbage", msgpack.packb([1, 2, 3]),
                 msgpack.packb({"v": 99, "type": "generate", "rid": "x"}),
                 msgpack.packb({"v": 2, "type": "no-such-type"}),
                 msgpack.packb({"v": 2, "type": "generate"}),  # no rid
                 msgpack.packb({"v": 2, "type": "cancel", "rid": 7})):
        worker.send(junk)
    worker.send(generate(rid="after-junk", prompt="Hi", max_tokens=3))
    events = worker.collect("after-junk")
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 3
    assert worker.proc.poll() is None


def test_a_generate_it_cannot_read_is_answered_not_left_waiting(worker):
    import msgpack

    # A Generate whose rid is readable but whose fields are not this protocol's (only a
    # supervisor bug could send it): its Error and Done come at once, not a silence the
    # supervisor would wait out until its request timeout.
    worker.send(msgpack.packb({"v": 2, "type": "generate", "rid": "unreadable",
                               "prompt": "Hi", "sampling": {"max_tokens": "3"}}))
    err, done = worker.collect("unreadable")
    assert (err.kind, err.code, err.rid) == ("error", INTERNAL, "unreadable")
    assert (done.finish_reason, done.completion_tokens) == ("error", 0)
    worker.send(generate(rid="next", prompt="Hi", max_tokens=3))
    assert worker.collect("next")[-1].completion_tokens == 3


def test_context_length_exceeded_without_compute(spawn, tiny_model):
    w = spawn(tiny_model, "--max-context-tokens", "64")
    ready, _ = w.wait_for("ready", timeout=60)
    assert ready.context_length == 64
    w.send(generate(rid="big", prompt="word " * 100, max_tokens=10))
    w.send(generate(rid="fits-not", prompt="Hi", max_tokens=64))
    for rid in ("big", "fits-not"):
        events = w.collect(rid)
        assert [e.kind for e in events] == ["error", "done"]
        err, done = events
        assert (err.code, err.param, err.rid) == (CONTEXT_LENGTH_EXCEEDED, "prompt", rid)
        assert "maximum context length is 64 tokens" in err.message
        assert done.finish_reason == "error" and done.prompt_tokens > 0
    w.send(StatusRequest(qid=1))
    status, _ = w.wait_for("status")
    assert status.steps == 0  # nothing was computed for either request
    w.send(generate(rid="fits", prompt="Hi", max_tokens=8))
    assert w.collect("fits")[-1].completion_tokens == 8


@pytest.mark.parametrize("how", ["message", "sigterm"])
def test_shutdown_answers_everything_and_exits_0(spawn, tiny_model, how):
    w = spawn(tiny_model, "--max-batch-size", "1")  # one slot: "queued" really waits
    w.wait_for("ready", timeout=60)
    w.send(long_gen("in-flight", "Hello"))
    w.send(long_gen("queued", "Hello"))
    w.wait_for("delta", rid="in-flight")
    if how == "message":
        w.send(Shutdown())
    else:
        w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(10) == 0, w.stderr_text()
    rest = []
    while True:  # everything the worker sent before exiting has arrived
        try:
            rest.append(w.recv(timeout=1.0))
        except TimeoutError:
            break
    dones = {e.rid: e for e in rest if e.kind == "done"}
    assert set(dones) == {"in-flight", "queued"}
    assert all(d.finish_reason == "cancelled" for d in dones.values())
    assert not any(e.kind == "started" and e.rid == "queued" for e in rest)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                             text=True)
        return bool(out.stdout.strip()) and not out.stdout.strip().startswith("Z")


def test_worker_dies_with_its_parent(tiny_model, tmp_path):
    # The test binds the sockets; an intermediate process spawns the worker and is killed.
    runtime = sockets.make_runtime_dir()
    ep = sockets.Endpoints.for_worker(runtime, "orphan")
    ctx = zmq.Context()
    evt = sockets.pull(ctx, ep.events, bind=True)
    sockets.push(ctx, ep.commands, bind=True)
    argv = [sys.executable, "-m", "worker", "--model", str(tiny_model), "--commands",
            ep.commands, "--events", ep.events, "--epoch", "1", "--state-dir", str(tmp_path)]
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); "
         "print(p.pid, flush=True); sys.stdin.read()", *argv],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert evt.poll(30_000), "the worker never sent a heartbeat"  # lifeline armed by now
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10   # (well under a second when the machine is idle)
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the worker outlived its parent"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        ctx.destroy(linger=0)
        sockets.remove_runtime_dir(runtime)


def test_demo_model_is_built_and_served(spawn, tmp_path):
    state = tmp_path / "demo-state"
    w = spawn("demo-random", state_dir=state)
    ready, _ = w.wait_for("ready", timeout=90)
    assert (ready.model, ready.random_weights) == ("demo-random", True)
    assert (state / "models" / "demo-random" / "config.json").exists()
    w.send(generate(rid="d", messages=[{"role": "user", "content": "Hi"}], max_tokens=5))
    events = w.collect("d")
    assert events[0].kind == "started" and events[-1].kind == "done"
    assert events[-1].completion_tokens == len(deltas_of(events))


# Injected at interpreter start: a thread that runs before main() and does not block
# SIGTERM (as the preloaded OpenBLAS's pool on Linux), and a second's pause after the link
# starts answering, so that a SIGTERM sent on its first "loading" lands in that second.
_EARLY_THREAD_SLOW_LINK = (
    "import threading, time, worker.link as l\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "real = l.Link.start\n"
    "def slow(self):\n"
    "    real(self)\n"
    "    time.sleep(1.0)\n"
    "l.Link.start = slow\n")


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "early-thread-slow-link"])
def test_sigterm_while_loading_exits_0_and_answers_queued(spawn, tmp_path, inject):
    env = None
    if inject:
        (tmp_path / "sitecustomize.py").write_text(_EARLY_THREAD_SLOW_LINK)
        env = {"PYTHONPATH": f"{REPO}:{tmp_path}"}
    # Building the random demo model in a fresh state dir takes about a second: time enough.
    w = spawn("demo-random", state_dir=tmp_path / "fresh", env=env)
    w.send(generate(rid="early", prompt="Hi", max_tokens=3))
    w.send(StatusRequest(qid=1))  # answered after the Generate was queued (same thread)
    status = w.recv(timeout=30)
    assert (status.kind, status.state) == ("status", "loading")
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(10) == 0, w.stderr_text()
    done = w.recv(timeout=2)
    assert (done.kind, done.rid, done.finish_reason) == ("done", "early", "cancelled")
    with pytest.raises(TimeoutError):
        w.recv(timeout=0.5)  # and nothing else: no Ready, no Started


@pytest.mark.parametrize("started", [0, 1], ids=["unstarted", "half-started"])
def test_a_link_closed_before_it_started_still_sends_what_was_queued(started):
    # The SIGTERM handler can run before link.start() or inside it (between its two
    # threads' starts): its Done must leave all the same.
    from protocol import decode_up
    from worker.link import Link
    from worker.status import WorkerStatus

    runtime = sockets.make_runtime_dir()
    ep = sockets.Endpoints.for_worker(runtime, "early")
    ctx = zmq.Context()
    try:
        evt = sockets.pull(ctx, ep.events, bind=True)
        sockets.push(ctx, ep.commands, bind=True)
        link = Link(zmq.Context(), ep.commands, ep.events, WorkerStatus(7), 60.0)
        if started:
            link._receiver.start()
        link.send(Done(epoch=7, rid="r", finish_reason=FinishReason.CANCELLED))
        link.close()
        got = []
        while evt.poll(1000):
            got.append(decode_up(evt.recv()))
        assert [(m.kind, getattr(m, "rid", None)) for m in got if m.kind != "heartbeat"] \
            == [("done", "r")]
        assert not (link._sender.is_alive() or link._receiver.is_alive())
    finally:
        ctx.destroy(linger=0)
        sockets.remove_runtime_dir(runtime)


def test_unknown_model_is_a_load_error(spawn):
    w = spawn("mlxd-test/definitely-not-a-model")
    err = w.recv(timeout=60)
    assert (err.kind, err.code, err.rid) == ("error", LOAD_FAILED, None)
    assert "mlxd-test/definitely-not-a-model" in err.message
    assert "not in the Hugging Face cache" in err.message
    assert "Traceback" not in err.message
    assert w.proc.wait(10) == 3


def test_kv_settings_the_batch_cannot_hold_are_load_errors(spawn, tiny_model, tmp_path):
    # A quantized KV cache of a model whose heads (16) MLX cannot quantize.
    w = spawn(tiny_model, "--kv-bits", "4", state_dir=tmp_path / "a")
    err = w.recv(timeout=60)
    assert (err.kind, err.code) == ("error", LOAD_FAILED) and "head dimension" in err.message
    assert w.proc.wait(10) == 3
    # A KV budget too small for any sequence.
    w = spawn(tiny_model, "--kv-budget", "100", state_dir=tmp_path / "b")
    err = w.recv(timeout=60)
    assert (err.kind, err.code) == ("error", LOAD_FAILED) and "--kv-budget" in err.message
    assert w.proc.wait(10) == 3


def test_the_kv_budget_caps_the_context(spawn, tiny_model, tmp_path):
    # The tiny model's KV: 2 layers × (keys + values) × 2 heads × 16 dims × 4 bytes = 512 B
    # a token, so 64 KiB hold 128 tokens.
    w = spawn(tiny_model, "--kv-budget", "64K", state_dir=tmp_path)
    ready, before = w.wait_for("ready", timeout=60)
    assert ready.context_length == 128
    assert "context capped at 128 tokens" in w.stderr_text()


def test_the_worker_warms_up_before_ready_with_heartbeats_flowing(spawn, tiny_model, tmp_path):
    """A slow first compile (here: a warm-up made to take 2 s) happens before Ready, and
    heartbeats say "loading" all along, so the supervisor never takes it for hung."""
    (tmp_path / "sitecustomize.py").write_text(
        "import time, worker.loop.batch as b\n"
        "real = b.Batch.warm\n"
        "def slow(self, *a, **k):\n"
        "    time.sleep(2)\n"
        "    return real(self, *a, **k)\n"
        "b.Batch.warm = slow\n")
    w = spawn(tiny_model, "--heartbeat-interval", "0.2",
              env={"PYTHONPATH": f"{REPO}:{tmp_path}"}, state_dir=tmp_path / "state")
    w.wait_for("ready", timeout=60)
    loading = [h for h in w.heartbeats if h.state == "loading"]
    assert len(loading) >= 5  # 2 s at one per 0.2 s
    assert "Traceback" not in w.stderr_text()
    w.send(generate(rid="first", prompt="Hi", max_tokens=3))
    assert w.collect("first")[-1].completion_tokens == 3
