"""The benchmarks' one output format (a titled table of (measure, value, verdict) rows) and
their one way to compute a ratio against a reference.

Why paired rounds: on the lent GPUs and on this shared CPU a side's own speed drifts by
±20-30% within one run, so medians of a handful of rounds per side cannot settle whether
mlxd is 3% slower than raw mlx-lm. Run many short rounds instead, the two sides back to
back in each (their order alternating, so neither always gets the warmer machine), and read
the ratio of each round: drift that hits one round hits both of its halves. The figure is
the geometric mean of the per-round ratios with a bootstrap 95% interval over rounds (the
rounds resampled with replacement), and the GPU's clocks are logged beside every round
where nvidia-smi exists, so a round that ran throttled can be seen.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable


def goal(value: float, op: str, target: float) -> str:
    """'goal >= 0.90: PASS' (or MISS) for a measured ratio."""
    ok = value >= target if op == ">=" else value <= target
    return f"goal {op} {target:g}: {'PASS' if ok else 'MISS'}"


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    for c0, c1, c2 in rows:
        print(f"  {c0.ljust(w0)}  {c1.ljust(w1)}  {c2}".rstrip())


# ---- paired rounds -------------------------------------------------------------------------

def paired_ratio(ref: list[float], ours: list[float], *, resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float, float]:
    """(geometric mean of ours[i] / ref[i], its bootstrap 95% interval low, high).
    Rounds where either side is missing (nan, 0) are left out."""
    import numpy as np

    logs = np.array([math.log(o / r) for r, o in zip(ref, ours)
                     if r and o and math.isfinite(r) and math.isfinite(o)])
    if len(logs) == 0:
        return (float("nan"),) * 3
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), (resamples, len(logs)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return math.exp(logs.mean()), math.exp(lo), math.exp(hi)


def ratio_verdict(ratio: tuple[float, float, float], op: str, target: float) -> str:
    """'ratio 0.981 [0.962-0.999]  goal >= 0.97: PASS' with whether the interval settles it:
    'settled' when the whole interval is on the verdict's side of the target."""
    point, lo, hi = ratio
    ok = point >= target if op == ">=" else point <= target
    inside = (lo >= target if op == ">=" else hi <= target) if ok else \
             (hi < target if op == ">=" else lo > target)
    return (f"ratio {point:.3f} [{lo:.3f}-{hi:.3f}]  {goal(point, op, target)}"
            f" ({'settled' if inside else 'within the interval'})")


def gpu_clocks() -> str | None:
    """'sm 1980 MHz, mem 2619 MHz, 41 C, 120 W' per GPU ('; '-joined), None without
    nvidia-smi (the CPU, a Mac)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        sm, mem, temp, power = (v.strip() for v in line.split(","))
        gpus.append(f"sm {sm} MHz, mem {mem} MHz, {temp} C, {power} W")
    return "; ".join(gpus) or None


@dataclass
class Rounds:
    """Each side's figure in every round, and the GPU clocks after each round."""
    figures: dict[str, list[float]]
    clocks: list[str | None] = field(default_factory=list)

    def ratio(self, side: str, ref: str) -> tuple[float, float, float]:
        """`side` over `ref`, paired by round: (geometric mean, 95% low, high)."""
        return paired_ratio(self.figures[ref], self.figures[side])


def in_turn(i: int, sides: dict[str, Callable[[int], float]]) -> dict[str, float]:
    """Round i of every side (`side(i)`), in the given order when i is even and reversed
    when odd; {name: figure}."""
    order = list(sides) if i % 2 == 0 else list(sides)[::-1]
    return {name: sides[name](i) for name in order}


def alternate(rounds: int, sides: dict[str, Callable[[int], float]], *, label: str = "",
              log=sys.stderr, until: float | None = None,
              now: Callable[[], float] = time.monotonic) -> Rounds:
    """`rounds` rounds of every side (`side(i)` runs round i and returns its figure), in
    the given order in even rounds and reversed in odd ones; each round's figures and the
    GPU clocks after it are logged to `log` (None: silent). `until` (a `now()` time): no
    round starts after it once two have run, so a run on a lease with a time limit ends
    with a table of the rounds it had time for rather than none."""
    got = Rounds({name: [] for name in sides})
    for i in range(rounds):
        if until is not None and i >= 2 and now() >= until:
            break
        for name, figure in in_turn(i, sides).items():
            got.figures[name].append(figure)
        got.clocks.append(gpu_clocks())
        if log is not None:
            figs = ", ".join(f"{n} {v[-1]:.4g}" for n, v in got.figures.items())
            clock = f"  [{got.clocks[-1]}]" if got.clocks[-1] else ""
            print(f"  {label} round {i}: {figs}{clock}", file=log, flush=True)
    return got
