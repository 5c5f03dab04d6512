"""The fuzz suite's seed and tally.

The seed is MLXD_FUZZ_SEED when set, else drawn at random; it is printed in the tally at
the end of the run, in the report header (without -q) and in every failure message, so
any failure reproduces with
`MLXD_FUZZ_SEED=<seed> make test PYTEST_ARGS=tests/fuzz`. The tally of statuses per
route is printed at the end of the run.
"""

from __future__ import annotations

import collections
import os
import random

import pytest

SEED = int(os.environ.get("MLXD_FUZZ_SEED") or random.SystemRandom().randrange(2 ** 32))
TALLY: collections.Counter = collections.Counter()   # (route, status) -> count


def pytest_report_header(config):
    return f"mlxd fuzz seed: {SEED} (reproduce with MLXD_FUZZ_SEED={SEED})"


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    tr = terminalreporter
    tr.section(f"mlxd fuzz: {sum(TALLY.values())} requests, seed {SEED}")
    by_route: dict = collections.defaultdict(collections.Counter)
    for (route, status), n in TALLY.items():
        by_route[route][status] += n
    for route in sorted(by_route):
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(by_route[route].items()))
        tr.write_line(f"{route:44} {sum(by_route[route].values()):5}  ({statuses})")


@pytest.fixture(scope="session")
def fuzz_seed() -> int:
    return SEED
