"""The worker's timeline while waves of concurrent chats run: what each step did and how
long it took, beside the client's send and first-token times, merged on one clock.

    python -m bench.worker_timeline [--size 2b] [--family gemma4] [--waves 3]
        [--streams 8] [--tokens 64] [--gather S] [--images | --as-text] [--flushes]
        [--phases]
        [-- server flags]

A diagnostic, not a ratio: it found where a 2b Gemma 4's 8-stream waves lost their time
on an H200 (issue 33, docs/benchmarks.md "Session 13"): the burst reached the batch as 1,
2 and 5 requests, and each prefill and merge step of a new shape took 70-250 ms there,
where a decode step took 22. The server runs a vision checkpoint built by
worker/demos/vision.py (bf16 on a GPU, float32 on the CPU), each wave new chats (no
prefix hits); the worker is traced by bench/timeline/sitecustomize.py (MLXD_TRACE), and
`--gather` sets the scheduler's GATHER in it (0: off)."""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SITE = Path(__file__).resolve().parent / "timeline"


def wave(port: int, model: str, streams: int, tokens: int, first: int, side: int = 0):
    """(start, wall s, results) of `streams` chats sent at once (bench.throughput's), each
    with an image of `side` pixels (0: text only) as bench.vision_throughput sends them."""
    from bench.throughput import stream_chat
    from bench.vision_throughput import image_png, messages

    images = [image_png(side, first + i) if side else None for i in range(streams)]

    def one(i):
        sent = time.perf_counter()  # (CLOCK_MONOTONIC on Linux, as the trace's)
        r = stream_chat(port, {"model": model, "messages": messages(first + i, images[i]),
                               "max_tokens": tokens, "temperature": 0})
        return {**r, "sent": sent}

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        out = list(pool.map(one, range(streams)))
    return t0, time.perf_counter() - t0, out


def read_trace(prefix: str) -> list[tuple[float, str]]:
    events = []
    for path in glob.glob(prefix + ".*"):
        for line in open(path):
            t, _, rest = line.rstrip("\n").partition(" ")
            events.append((float(t), rest))
    return sorted(events)


def full_step(event: str, width: int) -> bool:
    """Whether a trace line is a step in which `width` sequences decode and nothing waits
    or prefills (its waiting/prefilling/decoding counts)."""
    return event.startswith("step") and event.split()[3:6] == ["0", "0", str(width)]


def step_summary(events: list, width: int) -> str:
    """A trace's steps in short: the decode steps with `width` sequences decoding and
    nothing else (count, median and 90th percentile ms) and every other step (count,
    total and longest ms)."""
    full, other = [], []
    for _, e in events:
        if e.startswith("step"):
            (full if full_step(e, width) else other).append(float(e.split()[1]))
    full.sort()
    if not full:
        return f"no full decode steps; {len(other)} other steps, {sum(other):.0f} ms in all"
    return (f"{len(full)} decode steps of {width}: median {statistics.median(full):.2f} ms, "
            f"p90 {full[int(0.9 * (len(full) - 1))]:.2f}; {len(other)} other steps: "
            f"{sum(other):.0f} ms in all, longest {max(other, default=0):.0f}")


def trace_env(prefix: str, gather: float | None = None, phases: bool = False) -> dict:
    """A server's environment that traces its worker to `prefix`.<pid> (`phases`: each
    step's phases too, timed between synchronizations: bench/timeline/sitecustomize.py)."""
    env = {"MLXD_TRACE": prefix,
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)}
    if gather is not None:
        env["MLXD_GATHER"] = str(gather)
    if phases:
        env["MLXD_TRACE_PHASES"] = "1"
    return env


def timeline(t0: float, wall: float, out: list, events: list, flushes: bool) -> dict:
    """One wave's merged lines (ms from its start) and its figures."""
    marks = [(r["sent"], f"client sent #{i}") for i, r in enumerate(out)]
    marks += [(r["times"][0], f"client first content #{i}") for i, r in enumerate(out)
              if r["times"]]
    mine = [(t, e) for t, e in events if t0 - 0.01 <= t <= t0 + wall + 0.05]
    lines, full = [], []
    for t, e in sorted(marks + mine):
        if e.startswith("flush") and not flushes:
            continue
        if full_step(e, len(out)):
            full.append(float(e.split()[1]))
            if len(full) > 3:  # (the steady decode: counted, not listed)
                continue
        lines.append(f"{(t - t0) * 1e3:9.1f} ms  {e}")
    steps = [e for t, e in mine if t >= t0 and e.startswith("step")]
    first = next((i for i, e in enumerate(steps) if full_step(e, len(out))), len(steps))
    return {"lines": lines, "tokens": sum(r["tokens"] for r in out), "wall": wall,
            "ttft": sorted(r["ttft"] * 1e3 for r in out),
            "admitted": sum(e.startswith("admit") for _, e in mine),
            "steps_before_full": first, "full_steps": full}


def run(size: str, family: str, waves: int, streams: int, tokens: int,
        gather: float | None = None, flushes: bool = False, server_args=(),
        images: bool = False, as_text: bool = False, phases: bool = False) -> list[dict]:
    import mlx.core as mx

    from bench.make_model import MODELS_DIR
    from bench.serverproc import ServerProcess
    from worker.demos.vision import SIZES, build_vision_model

    dtype = "bfloat16" if mx.default_device() == mx.gpu else "float32"
    model = str(build_vision_model(MODELS_DIR / f"{size}-vision-{family}-{dtype}", size,
                                   family=family, dtype=dtype).path)
    if as_text:  # (the same weights served as a text model: bench.vision_throughput's)
        from bench.vision_throughput import text_copy

        model = str(text_copy(Path(model)))
    side = int(SIZES[size]["max_pixels"] ** 0.5) if images else 0
    with tempfile.TemporaryDirectory(prefix="mlxd-timeline-") as tmp:
        prefix = os.path.join(tmp, "trace")
        env = trace_env(prefix, gather, phases)
        with ServerProcess([model], "--max-batch-size", str(max(streams, 1)), *server_args,
                           env=env) as srv:
            srv.wait_healthy(timeout=300)
            wave(srv.port, model, streams, tokens, 100, side)  # (first sight of everything)
            runs = [wave(srv.port, model, streams, tokens, 1000 + 10 * k, side)
                    for k in range(waves)]
        time.sleep(0.2)
        events = read_trace(prefix)
    gathers = {e.split()[1] for _, e in events if e.startswith("gather ")}
    return [{**timeline(*r, events, flushes), "gather": gathers, "model": model} for r in runs]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--family", default="gemma4")
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--gather", type=float, default=None, help="the worker's GATHER, s")
    p.add_argument("--flushes", action="store_true", help="list every Delta's flush too")
    p.add_argument("--images", action="store_true", help="an image in every chat")
    p.add_argument("--as-text", action="store_true",
                   help="serve the checkpoint as a text model (no --images)")
    p.add_argument("--phases", action="store_true",
                   help="each step's phases too, timed between synchronizations (slower)")
    p.add_argument("server_args", nargs="*", help="after --: more mlxd flags")
    a = p.parse_args(argv)
    for w in run(a.size, a.family, a.waves, a.streams, a.tokens, a.gather, a.flushes,
                 a.server_args, a.images, a.as_text, a.phases):
        full = w["full_steps"]
        print(f"\n=== wave: {w['tokens'] / w['wall']:.0f} tok/s over the wall "
              f"{w['wall'] * 1e3:.0f} ms; TTFT ms {[round(x) for x in w['ttft']]}; "
              f"{w['steps_before_full']} steps before all {a.streams} decode; "
              f"{len(full)} full decode steps, median "
              f"{statistics.median(full) if full else float('nan'):.2f} ms; the worker's "
              f"GATHER {', '.join(sorted(w['gather']))} s")
        print("\n".join(w["lines"]))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
