"""The memory gate's verdicts at their edges (supervisor/memory/gate.py): under a budget a
load that needs less than what is left fits; what is left is never negative, however far
reservations or the budget are overdrawn; no pressure signal is not a critical one; and
the line the pool logs while a load waits."""

from __future__ import annotations

from supervisor.memory.gate import Verdict
from supervisor.memory.probe import NORMAL, MemoryReading
from tests.supervisor.test_memory import GiB, gate

FREE = MemoryReading(10 * GiB, 16 * GiB, NORMAL)


def test_under_a_budget_less_than_what_is_left_fits(tmp_path):
    budget = gate(tmp_path, memory_budget=8 * GiB)
    v = budget.judge(1 * GiB, FREE, committed=5 * GiB)
    assert v.fits and v.free_bytes == 3 * GiB
    assert budget.judge(8 * GiB, FREE).fits  # nothing committed: the whole budget


def test_no_pressure_signal_is_not_critical(tmp_path):
    """Where the OS gives no pressure level (None) the bytes alone decide."""
    assert gate(tmp_path).judge(1 * GiB, MemoryReading(10 * GiB, 16 * GiB)).fits


def test_what_is_left_is_never_negative(tmp_path):
    v = gate(tmp_path).judge(1 * GiB, FREE, reserved=12 * GiB)
    assert not v.fits and v.free_bytes == 0
    v = gate(tmp_path, memory_budget=8 * GiB).judge(1 * GiB, FREE, committed=9 * GiB)
    assert not v.fits and v.free_bytes == 0 and "budget" in v.reason


def test_the_waiting_line_says_need_and_free_in_gib():
    v = Verdict(False, 3 * GiB + GiB // 2, GiB // 4, "not enough available memory")
    assert v.describe() == "not enough available memory: need 3.50 GiB, free 0.25 GiB"
