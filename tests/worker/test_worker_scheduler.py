"""Scheduler semantics in-process with the real engine and an in-memory link.

The link records every event and lets a test react to one (put a Cancel when the first
Delta leaves, say), so "dropped at the next step" can be asserted exactly.
"""

from __future__ import annotations

import queue

from protocol.messages import (
    INTERNAL, Cancel, Generate, Shutdown, StatusRequest, unpack_ids,
)
from tests.generates import generate
from worker.loop.scheduler import Scheduler
from worker.status import WorkerStatus
from tests.worker.batchrun import make_batch


class FakeLink:
    def __init__(self):
        self.commands = queue.SimpleQueue()
        self.sent = []
        self.on_send = None

    def send(self, msg):
        self.sent.append(msg)
        if self.on_send:
            self.on_send(msg)

    def of(self, rid):
        return [m for m in self.sent if getattr(m, "rid", None) == rid]

    def kinds(self, rid):
        return [m.kind for m in self.of(rid)]


def serve(engine, commands, on_send=None, max_size=1, **scheduler_kw):
    """Run a scheduler over `commands`; a Shutdown ends it once every rid is done."""
    link, status = FakeLink(), WorkerStatus(epoch=3)
    rids = {c.rid for c in commands if isinstance(c, Generate)}
    done = set()

    def hook(msg):
        if msg.kind == "done":
            done.add(msg.rid)
            if done >= rids:
                link.commands.put(Shutdown())
        if on_send:
            on_send(msg, link)

    link.on_send = hook
    for c in commands:
        link.commands.put(c)
    Scheduler(engine, link, status, make_batch(engine, max_size=max_size), **scheduler_kw).run()
    return link, status


def test_generate_streams_started_deltas_done(engine):
    link, status = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=9,
                                           temperature=0.0)])
    kinds = link.kinds("a")
    assert kinds == ["started"] + ["delta"] * 9 + ["done"]
    done = link.of("a")[-1]
    assert (done.finish_reason, done.completion_tokens, done.epoch) == ("length", 9, 3)
    assert done.prompt_tokens == link.of("a")[0].prompt_tokens > 0
    assert all(len(unpack_ids(d.token_ids)) == 1 for d in link.of("a")[1:-1])
    prefill_chunks = -(-(done.prompt_tokens - 1) // 64)  # the engine fixture's prefill step
    # + one step moving the sequence from prefill to decoding (worker/loop/batch.py)
    assert status.steps == prefill_chunks + 1 + 9 and status.view.state == "draining"


def test_cancel_of_the_active_request_lands_at_the_next_step(engine):
    def cancel_after_third_delta(msg, link):
        if msg.kind == "delta" and len(link.of("a")) == 4:  # Started + 3 deltas
            link.commands.put(Cancel(rid="a"))

    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=500)],
                    cancel_after_third_delta)
    assert link.kinds("a") == ["started", "delta", "delta", "delta", "done"]
    done = link.of("a")[-1]
    assert (done.finish_reason, done.completion_tokens) == ("cancelled", 3)


def test_cancel_during_prefill_lands_between_chunks(engine):
    def cancel_on_start(msg, link):
        if msg.kind == "started":
            link.commands.put(Cancel(rid="a"))

    g = generate(rid="a", prompt="word " * 400, max_tokens=5)  # ~400 tokens: 7 chunks
    link, status = serve(engine, [g], cancel_on_start)
    assert link.kinds("a") == ["started", "done"]
    assert link.of("a")[-1].finish_reason == "cancelled"
    assert status.steps == 1  # one prefill chunk ran, then the cancel was seen


def test_waiting_request_cancelled_without_started(engine):
    def cancel_b_when_a_streams(msg, link):
        if msg.kind == "delta" and msg.rid == "a" and len(link.of("a")) == 2:
            link.commands.put(Cancel(rid="b"))
            link.commands.put(Cancel(rid="b"))          # idempotent
            link.commands.put(Cancel(rid="unknown"))    # ignored

    # Greedy: a sampled EOS would end `a` early (a random model's EOS has ~1/vocab odds).
    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=20, temperature=0),
                             generate(rid="b", prompt="Hi", max_tokens=20, temperature=0)],
                    cancel_b_when_a_streams)
    assert link.kinds("b") == ["done"]
    assert link.of("b")[0].finish_reason == "cancelled"
    # b's Done came while a was still streaming, and a finished normally.
    assert link.sent.index(link.of("b")[0]) < link.sent.index(link.of("a")[-1])
    assert link.of("a")[-1].finish_reason == "length"


def test_fifo_and_cancel_after_finish_is_ignored(engine):
    def late_cancel(msg, link):
        if msg.kind == "done" and msg.rid == "a":
            link.commands.put(Cancel(rid="a"))

    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=3),
                             generate(rid="b", prompt="Hi", max_tokens=3)], late_cancel)
    order = [(m.kind, m.rid) for m in link.sent if m.kind in ("started", "done")]
    assert order == [("started", "a"), ("done", "a"), ("started", "b"), ("done", "b")]
    assert link.kinds("a").count("done") == 1


def test_request_error_gives_error_then_done(engine):
    link, _ = serve(engine, [generate(rid="a", prompt=""),
                             generate(rid="b", prompt="Hi", max_tokens=2)])
    err, done = link.of("a")
    assert (err.kind, err.code, err.param) == ("error", "invalid_request", "prompt")
    assert (done.kind, done.finish_reason) == ("done", "error")
    assert link.of("b")[-1].finish_reason == "length"  # the worker kept serving


def test_exception_inside_generation_is_contained(engine, monkeypatch, caplog):
    real = engine.decoding

    def broken(prep):
        decoding = real(prep)
        if prep.gen.rid == "a":
            feed, fed = decoding.feed, []

            def one_token_then_boom(tok, row):
                if fed:
                    raise RuntimeError("boom: secret internals")
                fed.append(tok)
                return feed(tok, row)

            decoding.feed = one_token_then_boom
        return decoding

    monkeypatch.setattr(engine, "decoding", broken)
    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=5),
                             generate(rid="b", prompt="Hi", max_tokens=2)])
    kinds = link.kinds("a")
    assert kinds == ["started", "delta", "error", "done"]
    err, done = link.of("a")[-2:]
    assert err.code == INTERNAL and "boom" not in err.message
    assert (done.finish_reason, done.completion_tokens) == ("error", 1)
    assert "boom: secret internals" in caplog.text  # the traceback goes to the log
    assert link.of("b")[-1].finish_reason == "length"


def test_shutdown_cancels_active_and_waiting(engine):
    def shutdown_on_first_delta(msg, link):
        if msg.kind == "delta" and len(link.of("a")) == 2:
            link.commands.put(Shutdown())
            link.commands.put(generate(rid="c", prompt="Hi"))  # after the Shutdown

    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=100),
                             generate(rid="b", prompt="Hi", max_tokens=100)],
                    shutdown_on_first_delta)
    for rid in "abc":
        dones = [m for m in link.of(rid) if m.kind == "done"]
        assert len(dones) == 1 and dones[0].finish_reason == "cancelled", rid
    assert link.kinds("b") == ["done"] and link.kinds("c") == ["done"]


def test_status_request_reaching_the_scheduler_is_answered(engine):
    def ask(msg, link):
        if msg.kind == "started":
            link.commands.put(StatusRequest(qid=9))

    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=3)], ask)
    st = next(m for m in link.sent if m.kind == "status")
    assert (st.qid, st.state, st.active) == (9, "busy", ["a"])


def test_duplicate_rid_gets_one_done(engine):
    link, _ = serve(engine, [generate(rid="a", prompt="Hi", max_tokens=3),
                             generate(rid="a", prompt="Hi", max_tokens=3)])
    assert link.kinds("a").count("done") == 1


def test_steps_faster_than_the_stream_interval_share_a_delta(engine):
    gen = generate(rid="a", prompt="Hi", max_tokens=40, temperature=0.0)
    one_by_one, _ = serve(engine, [gen])
    merged, _ = serve(engine, [gen], stream_interval=10.0)  # nothing is that fast
    singles = [d for d in one_by_one.of("a") if d.kind == "delta"]
    batched = [d for d in merged.of("a") if d.kind == "delta"]
    # The first step goes out at once, the rest wait for the interval or the finish.
    assert len(singles) == 40 and len(batched) == 2
    assert len(unpack_ids(batched[0].token_ids)) == 1
    ids = [t for d in batched for t in unpack_ids(d.token_ids)]
    assert ids == [t for d in singles for t in unpack_ids(d.token_ids)]
    assert "".join(d.text for d in batched) == "".join(d.text for d in singles)
    assert merged.kinds("a")[-1] == "done" and merged.of("a")[-1].completion_tokens == 40


def test_heartbeats_carry_load_progress_only_while_loading():
    status = WorkerStatus(epoch=1)
    assert status.heartbeat().load_progress is None
    status.load_progress = 0.25  # a GGUF a quarter converted
    assert status.heartbeat().load_progress == 0.25
    status.publish("ready")
    assert status.heartbeat().load_progress is None  # loaded: no progress to show


def test_the_buffer_cache_goes_back_after_a_moment_idle_not_between_requests(engine,
                                                                           monkeypatch):
    """MLX's buffer cache is cleared once the worker has been idle `buffer_cache_idle`,
    not after each request: a request that follows at once finds its buffers."""
    import threading
    import time

    import worker.loop.scheduler as sched

    cleared, done_at = [], {}
    monkeypatch.setattr(sched, "return_buffers", lambda: cleared.append(time.monotonic()))
    link, status = FakeLink(), WorkerStatus(epoch=1)

    def hook(msg):
        if msg.kind != "done":
            return
        done_at[msg.rid] = time.monotonic()
        if msg.rid == "a":   # the next request 0.1 s later: inside the idle moment
            threading.Timer(0.1, link.commands.put, [generate(rid="b", prompt="Hi",
                                                              max_tokens=3)]).start()
        else:
            threading.Timer(1.2, link.commands.put, [Shutdown()]).start()

    link.on_send = hook
    link.commands.put(generate(rid="a", prompt="Hi", max_tokens=3))
    Scheduler(engine, link, status, make_batch(engine), buffer_cache_idle=0.4).run()
    assert link.kinds("b")[-1] == "done"
    assert len(cleared) == 1, cleared               # once, while idle after b
    assert cleared[0] - done_at["b"] >= 0.4 - 0.05


def test_an_echo_comes_after_started_and_before_the_output(engine):
    """The prompt's Delta (text, no token ids: no completion tokens), then the output."""
    link, _ = serve(engine, [generate(rid="e", prompt="Once upon a time", max_tokens=4,
                                      temperature=0.0, echo=True, logprobs=True,
                                      top_logprobs=1)])
    kinds = link.kinds("e")
    assert kinds[:2] == ["started", "delta"] and kinds[-1] == "done"
    prompt = link.of("e")[1]
    assert prompt.text == "Once upon a time" and prompt.n_tokens == 0
    started = link.of("e")[0]
    assert len(prompt.logprob_rows()) == started.prompt_tokens
    assert link.of("e")[-1].completion_tokens == 4


def test_a_batch_that_cannot_score_a_prompt_refuses_echo_with_logprobs(engine, monkeypatch):
    """A worker group's leader (and the one-at-a-time vision batch) cannot run the scoring
    pass: a 400 naming `echo`; echo alone still comes back."""
    from worker.loop.batch import Batch

    monkeypatch.setattr(Batch, "scores_prompts", False)
    link, _ = serve(engine, [
        generate(rid="x", prompt="Hi", max_tokens=2, echo=True, logprobs=True),
        generate(rid="y", prompt="Hi", max_tokens=2, echo=True)])
    assert link.kinds("x") == ["error", "done"]
    assert link.of("x")[0].param == "echo"
    assert link.kinds("y")[:2] == ["started", "delta"] and link.of("y")[1].text == "Hi"


def test_echo_with_max_tokens_0_is_the_prompt_alone(engine):
    """The spec's "prompt only": Started, the prompt's Delta (its rows scored), Done
    ("length", no completion tokens); nothing joins the batch."""
    link, status = serve(engine, [generate(rid="p", prompt="Once upon a time", max_tokens=0,
                                           echo=True, logprobs=True, top_logprobs=1)])
    assert link.kinds("p") == ["started", "delta", "done"]
    started, prompt, done = link.of("p")
    assert len(prompt.logprob_rows()) == started.prompt_tokens and prompt.n_tokens == 0
    assert (done.finish_reason, done.completion_tokens) == ("length", 0)
    assert status.steps == 0
