"""Where a request's time to first token goes (a short prompt, a cold 2000-token prompt,
a warm prefix, and a cold 2000-token chat message): raw mlx-lm, mlxd's batch in-process
(no HTTP, no worker process), and the server, on one model in one run.

    python -m bench.ttft_probe [--shape tiny|0.5b|7b] [--rounds 5]

Each figure is a median of rounds (the first dropped: compiles). The in-process batch is
worker/loop/batch.py driven as the scheduler drives it, with the per-step times of the 2000-token
requests printed: admission (prefix lookup and insert), then each step until its first
token. What the server adds over the in-process batch is the HTTP, IPC and scheduling
path; what the batch adds over raw is mlx-lm's BatchGenerator and mlxd's batch. The chat
row is the same kind of cold prompt as a user message: raw renders mlx-lm's
`apply_chat_template` and runs `stream_generate`, the server takes /v1/chat/completions
(template, tokenizer, the worker's preparation, the SSE chunks). Last, the chunks a worker
with the default settings picks for a cold 2000-token prompt on this device, from the
working memory it measures here (worker/loop/batch.py `_fit_chunk`).

With --trace, one more server (the default flags) runs the cold 2000-token prompt and
the cold chat message again with the worker traced (bench/timeline/sitecustomize.py),
and prints where each one's time to first token went, medians in ms: from the client's
send to the worker reading the Generate (HTTP, the supervisor, IPC), its preparation
(template, tokenizing, checks: a thread of its own), to its admission into the batch,
the admission itself (prefix lookup), the steps until its first token, and from that
step's end to the client's first content (the token's way back).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time

from bench.gpu import SHAPES, Raw, build, chat_rate, chat_text, default_dtype, server_stream
from bench.inprocess import Seq, greedy, in_process, time_methods
from bench.serverproc import ServerProcess


TIMED: list[str] = []


def _time_methods() -> None:
    """Time the batch's methods (and mx.eval): each call's ms goes to TIMED."""
    import importlib

    import mlx.core as mx
    g = importlib.import_module("mlx_lm.generate")
    time_methods([(g.PromptProcessingBatch, ("split", "generate", "prompt", "_copy")),
                  (g.GenerationBatch, ("__init__", "_step", "next")),
                  (g.BatchGenerator, ("_next",)),
                  (mx, ("eval", "async_eval", "clear_cache"))],
                 lambda label, s: TIMED.append(f"{label} {1000 * s:.2f} ms"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default=None)
    p.add_argument("--timers", action="store_true", help="time mlx-lm's batch methods")
    p.add_argument("--trace", action="store_true",
                   help="where the server's cold rows' time goes, from the worker's trace")
    p.add_argument("--server-args", default=None,
                   help="mlxd flags, one server per ';'-separated set (default: the default "
                   "server, and on a GPU also one tuned with --kv-budget 24G "
                   "--prefill-batch-size 8)")
    a = p.parse_args()
    import mlx.core as mx

    if a.server_args is None:  # (a 24G budget waits forever at the memory gate of a
        a.server_args = "--max-batch-size 32" + (  # small machine's CPU)
            ";--kv-budget 24G --max-batch-size 32 --prefill-batch-size 8"
            if mx.default_device() == mx.gpu else "")

    dtype = default_dtype(a.dtype)
    path = build(a.shape, dtype)
    rng = random.Random(0)
    vocab = 4000
    prompt = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731

    from mlx_lm.models.cache import make_prompt_cache
    raw = Raw(path)
    chats = [chat_text(raw.tokenizer, rng, SHAPES[a.shape]["vocab_size"], 2000)[0]
             for _ in range(a.rounds + 1)]  # (each server a fresh process: cold for each)
    message = lambda text: [{"role": "user", "content": text}]  # noqa: E731

    r_cold, r_pre, r_warm, r_chat = [], [], [], []
    for i in range(a.rounds + 1):
        long, suffix = prompt(2000), prompt(16)
        r_cold.append(raw.stream(prompt(32), 2)[0])
        r_pre.append(raw.stream(prompt(2000), 2)[0])
        cache = make_prompt_cache(raw.model)
        raw.model(mx.array(long)[None], cache=cache)
        mx.eval([c.state for c in cache])
        r_warm.append(raw.stream(suffix, 2, cache=copy.deepcopy(cache))[0])
        r_chat.append(raw.chat(message(chats[i]), 2))

    eng, batch = in_process(path, max_size=8)

    def run(ids, rid, trace=None):
        prep = greedy(eng, rid, ids, 2)
        t0 = time.perf_counter()
        batch.add(Seq(rid), prep)
        marks = [("add", time.perf_counter() - t0)]
        first = None
        while batch.members:
            outs = batch.step()
            marks.append(("step", time.perf_counter() - t0))
            for _, out in outs:
                if first is None:
                    first = time.perf_counter() - t0
        if trace is not None:
            trace.append(marks)
        return first

    if a.timers:
        _time_methods()
    b_cold, b_pre, b_warm, traces, pre_traces = [], [], [], [], []
    for _ in range(a.rounds + 1):
        long, suffix = prompt(2000), prompt(16)
        b_cold.append(run(prompt(32), "c"))
        b_pre.append(run(long, "l", pre_traces))
        b_warm.append(run(long + suffix, "w", traces))

    servers = {}
    for flags in a.server_args.split(";"):
        s_cold, s_pre, s_warm, s_chat = [], [], [], []
        with ServerProcess([str(path)], *flags.split()) as srv:
            srv.wait_healthy(timeout=900)
            for i in range(a.rounds + 1):
                long, suffix = prompt(2000), prompt(16)
                s_cold.append(server_stream(srv.port, str(path), prompt(32), 2)[0])
                s_pre.append(server_stream(srv.port, str(path), long, 2)[0])
                s_warm.append(server_stream(srv.port, str(path), long + suffix, 2)[0])
                s_chat.append(chat_rate(srv.port, str(path), message(chats[i]), 2)[0])
        servers[flags] = (s_cold, s_pre, s_warm, s_chat)

    med = lambda xs: statistics.median(xs[1:]) * 1000  # noqa: E731
    print(f"{a.shape} {dtype} on {mx.default_device()}: TTFT ms (median of {a.rounds})")
    print(f"  32-token prompt: raw {med(r_cold):.1f}  batch {med(b_cold):.1f}")
    print(f"  cold 2000:       raw {med(r_pre):.1f}  batch {med(b_pre):.1f}")
    print(f"  warm 2000+16:    raw {med(r_warm):.1f}  batch {med(b_warm):.1f}")
    print(f"  chat 2000 cold:  raw {med(r_chat):.1f}")
    for flags, (s_cold, s_pre, s_warm, s_chat) in servers.items():
        print(f"  server [{flags}]: 32-token {med(s_cold):.1f}, cold 2000 {med(s_pre):.1f}, "
              f"warm {med(s_warm):.1f}, chat cold 2000 {med(s_chat):.1f}")
    for name, kept in (("cold", pre_traces), ("warm", traces)):
        for marks in kept[1:3]:
            print(f"  batch {name} trace (ms since add):",
                  ", ".join(f"{k} {v * 1000:.1f}" for k, v in marks))
    for line in TIMED[-40:]:
        print("   ", line)
    default_chunks(eng, prompt(2000))
    if a.trace:
        traced(path, a.rounds, lambda: prompt(2000),
               [chat_text(raw.tokenizer, rng, SHAPES[a.shape]["vocab_size"], 2000)[0]
                for _ in range(a.rounds + 1)])


STAGES = ("to worker", "preparation", "to admission", "admission", "steps", "to client")


def traced(path, rounds: int, prompt, chats: list[str]) -> None:
    """The cold rows again on a traced server: each request's time by stage (the
    module's doc), medians of `rounds` (the first dropped)."""
    import tempfile

    from bench.worker_timeline import SITE, read_trace

    kinds = {"cold 2000": [], "chat cold 2000": []}
    with tempfile.TemporaryDirectory(prefix="mlxd-ttft-") as tmp:
        env = {"MLXD_TRACE": os.path.join(tmp, "trace"), "PYTHONPATH": os.pathsep.join(
            q for q in (str(SITE), os.environ.get("PYTHONPATH")) if q)}
        with ServerProcess([str(path)], "--max-batch-size", "32", env=env) as srv:
            srv.wait_healthy(timeout=900)
            for i in range(rounds + 1):
                for kind, send in (
                        ("cold 2000", lambda: server_stream(srv.port, str(path), prompt(), 2)),
                        ("chat cold 2000", lambda: chat_rate(
                            srv.port, str(path), [{"role": "user", "content": chats[i]}], 2))):
                    t0 = time.monotonic()  # (the trace's clock: CLOCK_MONOTONIC)
                    ttft = send()[0]
                    kinds[kind].append((t0, t0 + ttft))
                    time.sleep(0.05)  # (the worker's trace lines of this one written)
        events = read_trace(os.path.join(tmp, "trace"))
    print("  where a cold request's TTFT goes on the server (ms, medians):")
    for kind, sent in kinds.items():
        stages = [_stages(events, t0, t1) for t0, t1 in sent[1:]]
        stages = [s for s in stages if s is not None]
        if not stages:
            print(f"    {kind}: no trace (is bench/timeline importable?)")
            continue
        med = [statistics.median(s[k] for s in stages) * 1000 for k in range(len(STAGES))]
        ttft = statistics.median(t1 - t0 for t0, t1 in sent[1:]) * 1000
        print(f"    {kind:15} " + ", ".join(f"{n} {v:.1f}" for n, v in zip(STAGES, med))
              + f"  (sum {sum(med):.1f}, TTFT {ttft:.1f})")


def _stages(events: list, t0: float, t1: float) -> list[float] | None:
    """A request's stages (STAGES, s) from the trace lines between its send `t0` and its
    first content `t1`; None where a line is missing."""
    mine = [(t, e.split()) for t, e in events if t0 <= t <= t1]
    cmd = next(((t, f[2]) for t, f in mine if f[:2] == ["cmd", "Generate"]), None)
    if cmd is None:
        return None
    rid = cmd[1]
    prep = next((t for t, f in mine if f[:2] == ["prepare", rid]), None)
    admit = next(((t, float(f[3]) / 1000) for t, f in mine if f[:2] == ["admit", rid]), None)
    steps = [t for t, f in mine if f[0] == "step" and admit and t > admit[0]]
    if prep is None or admit is None or not steps:
        return None
    return [cmd[0] - t0, prep - cmd[0], admit[0] - admit[1] - prep, admit[1],
            steps[-1] - admit[0], t1 - steps[-1]]


def default_chunks(eng, ids: list[int]) -> None:
    """The chunk sizes a worker with the default settings picks for a cold prompt of
    `ids` on this device, from the working memory it measures here, without and with
    the device's spare memory (worker/loading/startup.py `device_spare`)."""
    from protocol.settings import BY_NAME
    from worker.loading.startup import PREFILL_LARGEST, device_spare
    from worker.loop.batch import Batch
    from worker.loop.sizing import ChunkSizer, KVSize, StepMemory

    d = {name: s.default for name, s in BY_NAME.items()}
    memory = StepMemory.measure(eng.model, eng.vocab_size or 0)
    print(f"  measured step memory: {memory.per_token / 1024:.0f} KiB a token, "
          f"{memory.per_pair:.1f} B a (query, key) pair; a prefill's own peak at "
          + ", ".join(f"{n} tokens {StepMemory.working(eng.model, n) / 2**20:.1f} MiB"
                      for n in (32, 128, 512, 2000)))
    for label, spare in (("the default --kv-budget alone", None),
                         ("with the device's spare memory", device_spare())):
        if label.startswith("with") and spare is None:
            print(f"  {label}: none (this device does not report its free memory)")
            continue
        batch = Batch(eng, max_size=d["max_batch_size"], prefill_step=d["prefill_step"],
                      prefill_batch=d["prefill_batch_size"], kv_budget=d["kv_budget"],
                      kvcache=None, kv=KVSize.measure(eng.model, None), step_memory=memory,
                      chunks=ChunkSizer(d["prefill_step"], PREFILL_LARGEST), spare=spare)
        batch.chunks.observe(0.0)  # (a worker's sizer has grown on its earlier prompts)
        batch.add(Seq("chunks"), greedy(eng, "chunks", ids, 2))
        sizes = []  # the prompt tokens each step prefilled
        while batch.members:
            before = batch.gen._counters.prompt_tokens
            batch.step()
            if batch.gen._counters.prompt_tokens > before:
                sizes.append(batch.gen._counters.prompt_tokens - before)
        batch.close()
        print(f"  chunks of a cold {len(ids)}-token prompt, {label}: {sizes}")


if __name__ == "__main__":
    main()
