"""bench/cores.py: each core measured in each pass, and the affinity given back."""

from __future__ import annotations

import os

from bench import cores


def test_each_core_is_measured_in_each_pass_and_the_affinity_restored():
    before = os.sched_getaffinity(0)
    got = cores.speeds(seconds=0.01, passes=2)
    assert set(got) == before and all(len(v) == 2 and min(v) > 0 for v in got.values())
    assert os.sched_getaffinity(0) == before
