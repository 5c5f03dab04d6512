"""The test-only fault hook (worker/faults.py) is off unless its variable is set, and
refuses what it does not know."""

from __future__ import annotations

import pytest

from worker.faults import ENV, Faults


def test_off_unless_asked_and_strict_about_what_it_is_asked():
    assert Faults.from_env({}) is None and Faults.from_env({ENV: " "}) is None
    assert Faults.from_env({ENV: "crash_after_tokens=4"}) == Faults(crash_after_tokens=4)
    with pytest.raises(ValueError, match="unknown fault"):
        Faults.from_env({ENV: "explode=1"})
    Faults(crash_after_tokens=None).after_token(10**6)  # nothing armed: nothing happens
    assert Faults.from_env({ENV: "hang_on_group_lost=1"}) == Faults(hang_on_group_lost=1)
    Faults(crash_after_tokens=3).group_lost()  # not armed: returns at once
