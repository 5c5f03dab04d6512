"""bench/report.py's paired ratio: the one way benchmarks compare mlxd with a reference.
Its interval must separate a 3% effect from none on rounds whose speed drifts by ±25%
(what the lent GPUs did), and the rounds must alternate which side runs first."""

from __future__ import annotations

import io
import random

from bench.report import alternate, paired_ratio, ratio_verdict


def drifting_rounds(effect: float, n: int = 40, seed: int = 1):
    """Each round's machine speed drifts by up to ±25%; ours = effect × ref, ±1% noise."""
    rng = random.Random(seed)
    ref, ours = [], []
    for _ in range(n):
        speed = 100 * rng.uniform(0.75, 1.25)
        ref.append(speed * rng.gauss(1, 0.01))
        ours.append(speed * effect * rng.gauss(1, 0.01))
    return ref, ours


def test_the_interval_tells_a_3_percent_gap_from_none_under_drift():
    point, lo, hi = paired_ratio(*drifting_rounds(0.97))
    assert lo <= 0.97 <= hi and hi < 1.0
    point, lo, hi = paired_ratio(*drifting_rounds(1.0))
    assert lo <= 1.0 <= hi and lo > 0.97
    assert "settled" in ratio_verdict((point, lo, hi), ">=", 0.97)
    assert "PASS" in ratio_verdict((point, lo, hi), ">=", 0.97)


def test_rounds_with_no_figure_are_left_out():
    point, lo, hi = paired_ratio([100, float("nan"), 100, 0], [90, 50, 90, 10])
    assert round(point, 6) == 0.9 and round(lo, 6) == round(hi, 6) == 0.9


def test_a_point_on_the_goal_with_a_wide_interval_is_not_settled():
    assert ratio_verdict((0.98, 0.94, 1.02), ">=", 0.97).endswith("(within the interval)")
    assert "MISS" in ratio_verdict((0.5, 0.4, 0.6), ">=", 0.97)
    assert "PASS" in ratio_verdict((1.2, 1.1, 1.3), "<=", 1.5)


def test_the_sides_take_turns_going_first():
    order = []
    log = io.StringIO()
    got = alternate(4, {"ref": lambda i: order.append(("ref", i)) or 10.0,
                        "ours": lambda i: order.append(("ours", i)) or 9.0}, log=log)
    assert order == [("ref", 0), ("ours", 0), ("ours", 1), ("ref", 1),
                     ("ref", 2), ("ours", 2), ("ours", 3), ("ref", 3)]
    assert got.figures == {"ref": [10.0] * 4, "ours": [9.0] * 4} and len(got.clocks) == 4
    assert [round(x, 9) for x in got.ratio("ours", "ref")] == [0.9] * 3
    assert log.getvalue().count("round") == 4


def test_no_round_starts_after_the_deadline_once_two_have_run():
    now = [0.0]

    def side(i):
        now[0] += 10.0  # (each side's round takes 10 s of the injected clock)
        return 1.0

    got = alternate(9, {"ref": side, "ours": side}, log=None, until=45.0, now=lambda: now[0])
    assert len(got.clocks) == 3 and len(got.figures["ours"]) == 3  # (40 s after two: one more)
    got = alternate(9, {"ref": side, "ours": side}, log=None, until=-1.0, now=lambda: now[0])
    assert len(got.clocks) == 2  # (two at least, whatever the clock)
    assert len(alternate(3, {"ref": side}, log=None).clocks) == 3  # (no deadline: all)
