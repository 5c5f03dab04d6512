"""Where one stream's time per token goes, by function: py-spy's samples of raw mlx-lm
`stream_generate` and of mlxd's batch in this process, set beside those of mlxd's worker and
supervisor while they serve the same stream over HTTP.

Why: on an H200 the served stream decodes at 0.89 × the same batch in-process (issue 36,
settled over 40 paired rounds), the worker's MLX thread spending ~430 µs a token more, and
neither the worker's own timers nor a reading of its loop could say where. A sampling
profiler can: each side runs rounds of one stream for `--seconds` while py-spy samples its
process with `--idle` (a waiting thread is sampled too, so a thread's share of the samples
is its share of the wall time) and `--nonblocking` (the process is not paused to be read).

    python -m bench.stream_profile [--shape 0.5b] [--seconds 20] [--tokens 128]
        [--rate 250] [--native] [--out DIR]

Printed: each side's tokens and rate; µs per generated token of the thread that runs MLX
by where it was (the innermost frame: self time), the rows sorted by what the served worker
spends beyond the in-process batch; the same by enclosing function (inclusive time); each
thread's µs per token, how much of it holding the GIL (a second py-spy with `--gil`), and
where it mostly was. py-spy's raw files are kept under `--out` (a flame graph's
input). `--native` adds C/C++ frames (MLX's own); py-spy then pauses the process for each sample,
which slows it: read its rows as where, not how much.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MLX_THREAD = "MainThread"  # the thread that runs MLX: raw's and the batch's here, the worker's
_LINE = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): ([^;]*)(.*) (\d+)$")
_NUMBER = re.compile(r":\d+\)$")


def py_spy() -> str:
    """The py-spy binary beside this Python, else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        sys.exit("py-spy is not installed (pip install py-spy)")
    return found


class Samples:
    """One process's samples: thread name -> Counter of stacks (tuples of frames)."""

    def __init__(self, path: Path):
        self.threads: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m:
                name, frames, n = m.groups()
                stack = tuple(f for f in frames.split(";") if f)
                self.threads[name][stack] += int(n)

    def passes(self) -> int:
        """Sampling passes: with --idle every thread alive is sampled in each, so the most
        samples any thread has."""
        return max((sum(c.values()) for c in self.threads.values()), default=0)

    def self_time(self, thread: str) -> collections.Counter:
        """Samples by innermost frame, with its line (the call that waited or worked)."""
        out = collections.Counter()
        for stack, n in self.threads.get(thread, {}).items():
            out[stack[-1] if stack else "(no frame)"] += n
        return out

    def inclusive(self, thread: str) -> collections.Counter:
        """Samples by each function on the stack (lines dropped, each counted once)."""
        out = collections.Counter()
        for stack, n in self.threads.get(thread, {}).items():
            for f in {_NUMBER.sub(")", f) for f in stack}:
                out[f] += n
        return out


class Side:
    """One side's recording: its samples per process and the tokens made meanwhile."""

    def __init__(self, name: str):
        self.name = name
        self.procs: dict[str, Samples] = {}  # --idle: every thread in every pass
        self.gil: dict[str, Samples] = {}  # --gil: only the thread holding the GIL
        self.tokens = 0
        self.wall = 0.0

    def us_per_token(self, proc: str, count: int) -> float:
        """µs per token for `count` of that process's samples."""
        passes = self.procs[proc].passes()
        return count / passes * self.wall / self.tokens * 1e6 if passes and self.tokens else 0.0

    def gil_us_per_token(self, proc: str, thread: str, rate: int) -> float:
        """µs per token that `thread` held the GIL: its --gil samples at the nominal rate
        (py-spy falling behind reads low)."""
        samples = self.gil.get(proc)
        held = sum(samples.threads.get(thread, {}).values()) if samples else 0
        return held / rate / self.tokens * 1e6 if self.tokens else 0.0


def record(side: Side, pids: dict[str, int], rounds, seconds: float, rate: int,
           native: bool, out: Path) -> Side:
    """Runs `rounds()` (one stream; returns its tokens) for `seconds` while py-spy samples
    each of `pids` (label -> pid)."""
    spies = {}
    for label, pid in pids.items():
        for how, flags in (("", ["--idle"]), (".gil", ["--gil"])):
            path = out / f"{side.name.replace(' ', '-')}.{label}{how}.txt"
            argv = [py_spy(), "record", "--pid", str(pid), "--format", "raw", "--output",
                    str(path), "--rate", str(rate), "--threads", *flags]
            # (py-spy reads native stacks only from a paused process)
            argv += ["--native"] if native and not how else ["--nonblocking"]
            spies[label + how] = (
                subprocess.Popen(argv,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), path)
    time.sleep(1.0)  # py-spy attaches
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        side.tokens += rounds()
    side.wall = time.perf_counter() - t0
    for label, (proc, path) in spies.items():
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
        _, err = proc.communicate(timeout=120)
        if not path.exists():
            sys.exit(f"py-spy wrote nothing for {side.name} {label}: {err.decode()[-2000:]}")
        (side.gil if label.endswith(".gil") else side.procs)[label.removesuffix(".gil")] = \
            Samples(path)
    # the second of attaching before the rounds is sampled too: count it in the wall time
    side.wall += 1.0
    return side


def table(title: str, sides: list[Side], proc_of: dict[str, str], how: str,
          served: str, local: str, top: int) -> None:
    """µs per token of each side's MLX thread by frame (`how`: self_time or inclusive),
    the rows most different between `served` and `local` first."""
    per = {}
    for s in sides:
        proc = proc_of[s.name]
        counts = getattr(s.procs[proc], how)(MLX_THREAD)
        per[s.name] = {f: s.us_per_token(proc, n) for f, n in counts.items()}
    frames = set().union(*per.values())
    by = sorted(frames, key=lambda f: -abs(per[served].get(f, 0) - per[local].get(f, 0)))
    names = [s.name for s in sides]
    print(f"\n{title}")
    print("  " + "".join(f"{n[:12]:>13}" for n in names) + f"{'diff':>9}  frame")
    for f in by[:top]:
        cells = "".join(f"{per[n].get(f, 0):13.1f}" for n in names)
        diff = per[served].get(f, 0) - per[local].get(f, 0)
        print(f"  {cells}{diff:9.1f}  {f[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rate", type=int, default=250, help="samples a second")
    p.add_argument("--dtype", default=None)
    p.add_argument("--native", action="store_true", help="C/C++ frames too")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/stream_profile"))
    a = p.parse_args()

    from bench.decode_probe import run_batch
    from bench.gpu import SHAPES, Raw, build, default_dtype, server_stream
    from bench.inprocess import in_process
    from bench.serverproc import ServerProcess

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = default_dtype(a.dtype)
    path = build(a.shape, dtype)
    rng = random.Random(0)
    vocab = SHAPES[a.shape]["vocab_size"]

    def prompt():
        return [rng.randrange(3, vocab) for _ in range(32)]

    raw = Raw(path)
    eng, batch = in_process(path, max_size=32)
    raw.stream(prompt(), 16)  # compiles, as the server's warm-up below does
    run_batch(eng, batch, [prompt()], 16, False)
    me = os.getpid()

    def raw_round():
        raw.stream(prompt(), a.tokens)
        return a.tokens

    def batch_round():
        run_batch(eng, batch, [prompt()], a.tokens, False)
        return a.tokens

    sides = [record(Side("raw"), {"self": me}, raw_round, a.seconds, a.rate, a.native, out),
             record(Side("in-process"), {"self": me}, batch_round, a.seconds, a.rate,
                    a.native, out)]
    with ServerProcess([str(path)]) as s:
        s.wait_healthy(600)
        server_stream(s.port, str(path), prompt(), 16)  # compiles
        worker = s.worker_pids()[0]
        sides.append(record(
            Side("served"), {"worker": worker, "supervisor": s.proc.pid},
            lambda: server_stream(s.port, str(path), prompt(), a.tokens)[2],
            a.seconds, a.rate, a.native, out))
    proc_of = {"raw": "self", "in-process": "self", "served": "worker"}

    print(f"\n{a.shape} {dtype}: one stream of {a.tokens} tokens, rounds for {a.seconds:g} s "
          f"per side, py-spy at {a.rate}/s{' with native frames' if a.native else ''}")
    for s in sides:
        mlx = s.procs[proc_of[s.name]]
        rows = [f"{s.tokens / s.wall:.1f} tok/s over {s.wall:.1f} s"]
        for label, samples in s.procs.items():
            for thread, c in sorted(samples.threads.items()):
                us = s.us_per_token(label, sum(c.values()))
                leaf, n = samples.self_time(thread).most_common(1)[0]
                gil = s.gil_us_per_token(label, thread, a.rate)
                rows.append(f"{label}/{thread}: {us:.0f} µs/token (GIL held {gil:.0f}), "
                            f"{n / sum(c.values()):.0%} in {leaf[:90]}")
        print(f"  {s.name}: " + "; ".join(rows[:1]) + "\n    " + "\n    ".join(rows[1:])
              + f"\n    ({mlx.passes()} passes)")
    table("MLX thread, µs per token by innermost frame (self time)", sides, proc_of,
          "self_time", "served", "in-process", a.top)
    table("MLX thread, µs per token by enclosing frame (inclusive time)", sides, proc_of,
          "inclusive", "served", "in-process", a.top)
    print(f"\npy-spy's raw files: {out}")



if __name__ == "__main__":
    from supervisor.workers import blas

    blas.reexec()  # as bench/single_ab.py: raw multiplies with the BLAS the workers use
    main()
