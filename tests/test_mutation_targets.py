"""`make mutate`'s list (mutation/modules.toml) names modules and the tests that cover
them by path: a module or a test moved without the list following would make the target
fail late (after minutes of mutants) or mutate nothing. Checked here, in the fast suite."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_module_and_test_that_make_mutate_names_exists():
    targets = tomllib.loads((REPO / "mutation" / "modules.toml").read_text())["module"]
    assert len(targets) >= 5
    missing = [t["path"] for t in targets if not (REPO / t["path"]).is_file()]
    missing += [test for t in targets for test in t["tests"]
                if not (REPO / test.split("::")[0]).is_file()]
    assert not missing, missing
