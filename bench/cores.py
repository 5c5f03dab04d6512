"""Each CPU core's speed, pass after pass: whether a host's cores run at one speed.

    python -m bench.cores [--passes 3] [--seconds 0.2]

Why: a small model's decode on a GPU is bound by the CPU thread that launches its kernels
(MLX's CUDA backend keeps that thread busy through the step: bench/token_cpu.py), so a
round runs as fast as the core it lands on. On the lent H200 hosts one stream's decode read
either 150-170 or 230-280 tok/s, raw mlx-lm and mlxd alike, round by round. This prints a
pure-Python loop's rate on each core (the process pinned to it) in several passes: on
those hosts (2026-11-28) every one of the 16 vCPUs ran at about 7 M iterations/s in some
passes and 10-12 in others, so the speed belongs to the moment, not to the core, and
pinning a benchmark to the cores that measured fastest did not narrow its rounds (tried:
bench.single_ab's rates still spread 115-245 tok/s). What settles a small effect there is
many paired rounds (bench/report.py), not a choice of cores.

Linux only (`os.sched_setaffinity`).
"""

from __future__ import annotations

import argparse
import os
import time


def speed(seconds: float = 0.05) -> float:
    """This thread's pure-Python loop rate, M iterations/s."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n / seconds / 1e6


def speeds(seconds: float = 0.05, passes: int = 3) -> dict[int, list[float]]:
    """Each allowed core's `speed` in each pass (this thread pinned to it meanwhile); the
    thread's affinity is as it was after."""
    allowed = sorted(os.sched_getaffinity(0))
    got: dict[int, list[float]] = {c: [] for c in allowed}
    try:
        for _ in range(passes):
            for c in allowed:
                os.sched_setaffinity(0, {c})
                got[c].append(speed(seconds))
    finally:
        os.sched_setaffinity(0, allowed)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2)
    a = p.parse_args()
    for c, vs in speeds(a.seconds, a.passes).items():
        print(f"core {c:3d}: " + " ".join(f"{v:6.2f}" for v in vs))


if __name__ == "__main__":
    main()
