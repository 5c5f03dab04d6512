"""Per-token CPU of each side of a decode comparison, by process and thread.

Why: on a shared, noisy machine a decode rate's ratio needs many rounds to settle a few %,
while CPU time per token hardly moves with the machine's load: it says where mlxd spends
more than raw mlx-lm (issue 36) in one short run. Sides in this process (raw
`stream_generate`, the in-process batch) count the calling thread (the one that runs MLX,
its graph building and launches) and the process's other threads (on a CPU, MLX's own
compute thread); a server counts its worker's main thread (the MLX thread), the worker's
other threads (the link's sender and receiver, ZeroMQ's I/O, MLX's), the supervisor
process and the client's (this process's) CPU for the request. Figures are medians of the
rounds, in µs per generated token.
"""

from __future__ import annotations

import collections
import os
import statistics
import time

import psutil

PARTS = ("MLX thread", "other threads", "supervisor", "client")


def _threads(p: psutil.Process) -> dict[int, float]:
    """{thread id: its CPU seconds so far}. On Linux from the scheduler's own count
    (/proc/PID/task/TID/schedstat, ns): psutil's figures there are in clock ticks (10 ms),
    which over one 128-token round of a GPU's 0.7 s is 78 µs a token, the size of what a
    side differs by; elsewhere psutil's (µs on macOS)."""
    tasks = f"/proc/{p.pid}/task"
    try:
        if os.path.isdir(tasks):
            out = {}
            for tid in os.listdir(tasks):
                try:
                    with open(f"{tasks}/{tid}/schedstat") as f:
                        out[int(tid)] = int(f.read().split()[0]) / 1e9
                except (OSError, ValueError, IndexError):  # (a thread gone meanwhile)
                    pass
            if out:
                return out
        return {t.id: t.user_time + t.system_time for t in p.threads()}
    except psutil.NoSuchProcess:
        return {}


def _cpu(p: psutil.Process) -> float:
    """The process's CPU seconds so far (its live threads', as `_threads` reads them)."""
    return sum(_threads(p).values())


class TokenCPU:
    def __init__(self):
        # side -> part -> [µs per token, one per round]
        self.rounds: dict = collections.defaultdict(lambda: collections.defaultdict(list))

    def local(self, side: str, run, tokens):
        """`run()` in this process; returns its result. `tokens`: how many it generated,
        or a function of its result that says."""
        t0, p0 = time.thread_time(), time.process_time()
        out = run()
        thread, proc = time.thread_time() - t0, time.process_time() - p0
        tokens = tokens(out) if callable(tokens) else tokens
        self._add(side, tokens, {"MLX thread": thread, "other threads": proc - thread})
        return out

    def server(self, side: str, server, run, tokens_of):
        """`run()` streams from `server` (bench/serverproc.py); `tokens_of(result)`: the
        tokens it generated. Returns its result."""
        worker = psutil.Process(server.worker_pids()[0])
        supervisor = psutil.Process(server.proc.pid)
        w0, s0, c0 = _threads(worker), _cpu(supervisor), time.process_time()
        out = run()
        w1, s1, c1 = _threads(worker), _cpu(supervisor), time.process_time()
        spent = {t: v - w0.get(t, 0.0) for t, v in w1.items()}
        main = spent.pop(worker.pid, 0.0)
        self._add(side, tokens_of(out), {"MLX thread": main,
                                         "other threads": sum(spent.values()),
                                         "supervisor": s1 - s0, "client": c1 - c0})
        return out

    def _add(self, side: str, tokens: int, parts: dict) -> None:
        if tokens <= 0:
            return
        for part, seconds in parts.items():
            self.rounds[side][part].append(seconds / tokens * 1e6)

    def rows(self, ref: str = "raw") -> list[tuple[str, str, str]]:
        """print_table rows: each side's parts and total, and its total over `ref`'s."""
        totals = {}
        rows = []
        for side, parts in self.rounds.items():
            med = {p: statistics.median(v) for p, v in parts.items()}
            totals[side] = sum(med.values())
            rows.append((side, ", ".join(f"{p} {med[p]:.0f}" for p in PARTS if p in med),
                         f"total {totals[side]:.0f} us/token"))
        if ref in totals and totals[ref] > 0:
            rows = [(s, a, f"{b} ({totals[s] / totals[ref]:.3f} x {ref})")
                    for s, a, b in rows]
        return rows
