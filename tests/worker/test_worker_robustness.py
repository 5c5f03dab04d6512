"""Issue #9, findings 2 and 6a: no request may poison the worker.

A `top_k` at or above the vocabulary made mlx-lm's compiled sampler raise inside its
trace, which left MLX's global random key without a primitive: that request got a 500,
and so did every later one on the worker. These tests pin the mechanism, the mapping of
such values before they reach MLX, the recovery after a failure that still gets through,
and the way out (a distinct exit) when recovery is impossible.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from protocol.messages import INTERNAL, INVALID_REQUEST, Generate
from tests.generates import generate
from tests.worker.test_worker_scheduler import FakeLink, serve
from worker.text import sampling
from worker.errors import RequestError
from worker.loop.scheduler import Scheduler
from worker.errors import WorkerBroken
from worker.status import WorkerStatus
from tests.worker.batchrun import make_batch, steps as run_steps


# The top_k that marks a "bad" request for the poisoned samplers below. The worker's own
# sampler takes it as "no filtering" (it is above the vocabulary).
POISON = 4242


def prompt_gen(rid: str, **kw) -> Generate:
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 1.0)
    if rid.startswith("bad"):
        kw["top_k"] = POISON
    return generate(rid=rid, prompt="Once upon a time", **kw)


def tokens(engine, g: Generate) -> list[int]:
    return [out[0] for out in run_steps(engine, engine.prepare(g))
            if out is not None and out[0] >= 0]


@pytest.fixture
def poisoned_sampler(engine, monkeypatch):
    """Requests whose rid starts with "bad" (top_k=POISON) get mlx-lm's sampler with a
    top_k it refuses inside its compiled trace: the original failure, bypassing the
    worker's mapping."""
    real = sampling.sampler_for
    assert POISON > engine.vocab_size

    def sampler_for(sp, vocab_size):
        if sp.top_k == POISON:
            return make_sampler(1.0, top_k=vocab_size + 1000)
        return real(sp, vocab_size)

    monkeypatch.setattr(sampling, "sampler_for", sampler_for)


def test_a_raise_inside_the_compiled_sampler_poisons_the_random_key_until_reseeded(engine):
    """The mechanism (mlx_lm/sample_utils.py compiles with mx.random.state as input and
    output): what the worker's recovery has to undo."""
    logprobs = mx.zeros((1, engine.vocab_size))
    try:
        with pytest.raises(ValueError, match="top_k"):
            make_sampler(1.0, top_k=engine.vocab_size)(logprobs)
        with pytest.raises(RuntimeError, match="without a primitive"):
            mx.eval(mx.random.uniform(shape=(2,)))
    finally:
        sampling.reseed()
    mx.eval(mx.random.uniform(shape=(2,)))  # cured


def test_top_k_at_or_above_the_vocabulary_means_no_filtering(engine):
    v = engine.vocab_size
    unfiltered = tokens(engine, prompt_gen("a", seed=5, max_tokens=12))
    for top_k in (v, v + 1000):
        assert tokens(engine, prompt_gen("a", seed=5, max_tokens=12, top_k=top_k)) == unfiltered
    # ... while a real top_k still filters: top_k=1 is greedy.
    greedy = tokens(engine, prompt_gen("a", max_tokens=12, temperature=0.0))
    assert tokens(engine, prompt_gen("a", seed=5, max_tokens=12, top_k=1)) == greedy


def test_a_min_p_the_compiled_sampler_would_refuse_is_a_request_error(engine):
    with pytest.raises(RequestError) as e:
        engine.prepare(prompt_gen("m", min_p=1.5))
    assert (e.value.code, e.value.param) == (INVALID_REQUEST, "min_p")


@pytest.mark.parametrize("seed", [-1, -(2 ** 63), 2 ** 63 - 1])
def test_every_int64_seed_is_accepted_and_reproducible(engine, seed):
    first = tokens(engine, prompt_gen("s", seed=seed, max_tokens=12))
    assert len(first) == 12
    assert tokens(engine, prompt_gen("s", seed=seed, max_tokens=12)) == first
    # Mapped modulo 2**64, as mx.random.seed takes it: -1 is the largest uint64.
    assert tokens(engine, prompt_gen("s", seed=seed % 2 ** 64, max_tokens=12)) == first


def test_a_failed_sampler_step_leaves_the_worker_able_to_generate(engine, poisoned_sampler):
    link, _ = serve(engine, [prompt_gen("bad"), prompt_gen("next"),
                             prompt_gen("seeded", seed=3, temperature=0.7)])
    assert link.kinds("bad") == ["started", "error", "done"]
    err, done = link.of("bad")[-2:]
    assert err.code == INTERNAL and done.finish_reason == "error"
    # Random sampling (the compiled samplers and the global key) works right after.
    for rid in ("next", "seeded"):
        assert link.kinds(rid)[0] == "started"
        done = link.of(rid)[-1]
        assert (done.finish_reason, done.completion_tokens) == ("length", 6), rid


def test_when_recovery_fails_the_worker_gives_up_instead_of_failing_every_request(
        engine, poisoned_sampler, monkeypatch, caplog):
    def probe():
        raise RuntimeError("[eval] Attempting to eval an array without a primitive.")

    monkeypatch.setattr(engine, "probe", probe)
    link, status = FakeLink(), WorkerStatus(epoch=3)
    link.commands.put(prompt_gen("bad"))
    link.commands.put(prompt_gen("queued"))
    with pytest.raises(WorkerBroken):
        # One sequence at a time: "queued" waits (with batching it would be in the batch,
        # and ended with it: test_worker_batching).
        Scheduler(engine, link, status, make_batch(engine, max_size=1)).run()
    assert link.kinds("bad") == ["started", "error", "done"]
    assert "done" not in link.kinds("queued")  # left to the supervisor to re-queue
    assert "must be replaced" in caplog.text


def test_broken_worker_answers_the_failed_request_then_exits_with_its_own_code(
        spawn, tiny_model, tmp_path):
    """The real process: the failed request gets Error + Done, what waited gets nothing
    (the supervisor re-queues what never started), and the exit code says why."""
    # The fault, injected at interpreter start: the sampler fails as in finding 2 and the
    # probe after it fails too (a worker whose MLX state is beyond repair).
    (tmp_path / "sitecustomize.py").write_text(
        "import worker.text.engine as e, worker.text.sampling as s\n"
        "from mlx_lm.sample_utils import make_sampler\n"
        "real = s.sampler_for\n"
        "s.sampler_for = lambda sp, v: (make_sampler(1.0, top_k=v + 1)\n"
        f"                                if sp.top_k == {POISON} else real(sp, v))\n"
        "def probe(self):\n"
        "    raise RuntimeError('probe failed')\n"
        "e.TextEngine.probe = probe\n")
    from tests.worker.harness import REPO

    w = spawn(tiny_model, "--max-batch-size", "1", env={"PYTHONPATH": f"{REPO}:{tmp_path}"})
    w.wait_for("ready", timeout=60)
    w.send(prompt_gen("bad"))
    w.send(prompt_gen("queued"))
    events = w.collect("bad", timeout=30)
    assert [e.kind for e in events] == ["started", "error", "done"]
    assert events[1].code == INTERNAL and events[2].finish_reason == "error"
    assert w.proc.wait(20) == 4
    assert "exiting with code 4" in w.stderr_text()
    rest = []
    while w.evt.poll(200):
        rest.append(w.evt.recv())
    from protocol import decode_up

    assert not [m for m in map(decode_up, rest) if getattr(m, "rid", None) == "queued"]


def test_no_log_line_outgrows_what_the_supervisor_reads():
    """An error that echoes a client's input (llguidance's once carried the whole grammar
    of a 0.6 MB schema) must not become one line of megabytes on stderr."""
    import logging

    from worker.__main__ import LOG_LINE_LIMIT, LogLineCap

    record = logging.LogRecord("worker", logging.ERROR, __file__, 1, "failed: %s",
                               ("x" * 10 ** 6,), None)
    lines = LogLineCap("%(levelname)s %(message)s").format(record).split("\n")
    assert lines[0].startswith("ERROR failed: xxx")
    assert all(len(line) <= LOG_LINE_LIMIT + 40 for line in lines)
