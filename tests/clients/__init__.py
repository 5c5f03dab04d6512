"""The coding agents' command-line clients that the integration tests drive against a
real mlxd (Codex, Claude Code, opencode), and the Vercel AI SDK's packages that
ai_sdk.mjs here runs (tests/integration/test_ai_sdk.py). They are pinned in package.json
here, since the tests were written against what those versions send, and `make clients`
(part of `make test`) installs them from the npm registry into node_modules/ here
(git-ignored). Without npm their tests skip; CI sets MLXD_REQUIRE_UI_TOOLS=1, and there a
missing client fails, as a missing browser does for tests/ui/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

BIN = Path(__file__).parent / "node_modules" / ".bin"


def cli(name: str, override: str) -> str:
    """The installed client `name` (or the executable the environment variable `override`
    names); skips the test without one, or fails it under MLXD_REQUIRE_UI_TOOLS=1."""
    if os.environ.get(override):
        return os.environ[override]
    if (BIN / name).exists():
        return str(BIN / name)
    why = f"no {name} CLI: `make clients` installs it from npm (tests/clients/package.json)"
    if os.environ.get("MLXD_REQUIRE_UI_TOOLS") == "1":
        pytest.fail(why + " and MLXD_REQUIRE_UI_TOOLS=1")
    pytest.skip(why)
