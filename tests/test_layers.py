"""The process boundaries, enforced: the supervisor never loads MLX (that is the point of
the worker process), the worker never loads aiohttp, and `protocol/` loads neither.

Each check imports every module of a package in a fresh interpreter (a module imported by
another test would hide a violation here) and reads `sys.modules` afterwards.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def modules_of(package: str) -> list[str]:
    root = REPO / package
    names = [package]
    for info in pkgutil.walk_packages([str(root)], prefix=package + "."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


def loaded_after_importing(modules: list[str]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_the_supervisor_never_loads_mlx():
    mods = modules_of("supervisor")
    assert "supervisor.app" in mods and len(mods) > 20
    loaded = top_level(loaded_after_importing(mods + ["supervisor.app"]))
    assert "mlx" not in loaded and "mlx_lm" not in loaded
    assert "worker" not in loaded, "the supervisor imports worker code"


def test_the_worker_never_loads_aiohttp():
    mods = modules_of("worker")
    assert "worker.engine" in mods
    loaded = top_level(loaded_after_importing(mods))
    assert "aiohttp" not in loaded and "supervisor" not in loaded


@pytest.mark.parametrize("forbidden", ["mlx", "aiohttp", "supervisor", "worker"])
def test_protocol_loads_neither_side(forbidden):
    loaded = top_level(loaded_after_importing(modules_of("protocol")))
    assert forbidden not in loaded
