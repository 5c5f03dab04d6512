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
    assert "worker.text.engine" in mods
    loaded = top_level(loaded_after_importing(mods))
    assert "aiohttp" not in loaded and "supervisor" not in loaded


@pytest.mark.parametrize("forbidden", ["mlx", "aiohttp", "supervisor", "worker"])
def test_protocol_loads_neither_side(forbidden):
    loaded = top_level(loaded_after_importing(modules_of("protocol")))
    assert forbidden not in loaded


# ---- imports inside the project: no cycles, layers point one way --------------------------

def runtime_imports(package_dirs=("protocol", "supervisor", "worker"),
                    type_only: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports when it runs (anywhere in its code, but
    not under `if TYPE_CHECKING:`, which only type checkers read; `type_only` counts
    those too)."""
    import ast

    graph: dict[str, set[str]] = {}
    for package in package_dirs:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            name = name.removesuffix(".__init__")
            tree = ast.parse(path.read_text())
            skip = set() if type_only else {
                id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
            deps = set()
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.add(node.module)
                    deps |= {f"{node.module}.{a.name}" for a in node.names}
            graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    # Type-only imports count: a loop a type checker must untangle is a loop a reader must
    # too, and it is one step from a runtime import.
    graph = runtime_imports(("protocol", "supervisor", "worker", "mlxctl"), type_only=True)
    assert "supervisor.workers.runner" in graph and "mlxctl.client" in graph
    assert "supervisor.workers.handle" in graph["supervisor.workers.observer"]
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


# Inside the supervisor, layers point one way: HTTP surfaces → worker management → protocol.
LOWER = ("supervisor.workers", "supervisor.memory")
UPPER = ("supervisor.http", "supervisor.api", "supervisor.admin",
         "supervisor.app", "supervisor.cli")


def test_worker_management_never_imports_the_http_layer():
    graph = runtime_imports()
    lower = [m for m in graph if m.startswith(LOWER)]
    assert "supervisor.workers.pool" in lower and "supervisor.memory.gate" in lower
    bad = {m: sorted(d for d in graph[m] if d.startswith(UPPER)) for m in lower}
    assert not {m: d for m, d in bad.items() if d}, bad
    http = [m for m in graph if m.startswith("supervisor.http")]
    assert not {m: graph[m] & {d for d in graph if d.startswith("supervisor.api")} for m in http
                if graph[m] & {d for d in graph if d.startswith("supervisor.api")}}


def test_bench_never_loads_the_tests():
    mods = modules_of("bench")
    assert "bench.serverproc" in mods
    loaded = top_level(loaded_after_importing(mods))
    assert "tests" not in loaded and "bench" in loaded


def test_no_supervisor_module_imports_worker_code_even_lazily():
    # Importing every module (above) cannot see an import inside a function body; this
    # reads every import statement. What both sides share lives in protocol/.
    graph = runtime_imports()
    bad = {m: sorted(d for d in deps if d.startswith("worker"))
           for m, deps in graph.items() if m.startswith("supervisor")}
    assert not {m: d for m, d in bad.items() if d}, bad
    worker_side = {m: sorted(d for d in deps if d.startswith("supervisor"))
                   for m, deps in graph.items() if m.startswith("worker")}
    assert not {m: d for m, d in worker_side.items() if d}, worker_side


def test_the_server_never_imports_mlxctl():
    # mlxctl/ is the client: it may import the server's pure modules, never the reverse.
    # Statements first (an import inside a function body counts), then what importing
    # every server module actually loads.
    graph = runtime_imports(("protocol", "supervisor", "worker", "mlxctl"))
    assert "mlxctl.client" in graph and "supervisor.config" in graph["mlxctl.client"]
    bad = {m: sorted(d for d in deps if d.split(".")[0] == "mlxctl")
           for m, deps in graph.items() if m.split(".")[0] != "mlxctl"}
    assert not {m: d for m, d in bad.items() if d}, bad
    server = modules_of("protocol") + modules_of("supervisor") + modules_of("worker")
    assert "mlxctl" not in top_level(loaded_after_importing(server + ["supervisor.app"]))


# Inside the worker, rooms by role, each importing only the rooms below it (or itself):
# a reader starts at the bottom and never needs a higher room to understand a lower one.
WORKER_FLOORS = [
    # the typed errors, the built-in demo models, and the process's own I/O (ZeroMQ link,
    # lifeline, status, test faults): they import nothing of the worker's rooms
    {"worker.errors", "worker.demos", "worker.link", "worker.lifeline", "worker.status",
     "worker.faults"},
    {"worker.text", "worker.kvcache", "worker.media"},  # tokens in and out; KV kept; media in
    {"worker.speculative"},                    # drafting and verifying several tokens a step
    {"worker.loop"},                           # the MLX thread's loop, its batch
    {"worker.vision", "worker.pooling", "worker.speech"},  # the engines of other kinds
    {"worker.loading"},                        # a name becomes a loaded, started model
    {"worker.group"},                          # several processes serve one model
    {"worker.__main__"},                       # the process
]


def worker_room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def worker_floor(module: str) -> int:
    room = worker_room(module)
    for floor, rooms in enumerate(WORKER_FLOORS):
        if room in rooms:
            return floor
    raise AssertionError(f"{module}: a worker room with no floor in WORKER_FLOORS")


def test_worker_rooms_import_only_downward():
    graph = runtime_imports(type_only=True)
    worker = {m: deps for m, deps in graph.items() if m.startswith("worker.")}
    assert "worker.loop.batch" in worker and "worker.text.engine" in worker
    upward = {f"{m} -> {d}" for m, deps in worker.items() for d in deps
              if d.startswith("worker.") and worker_room(d) != worker_room(m)
              and worker_floor(d) >= worker_floor(m)}
    assert not upward, sorted(upward)
    # The root holds only the process; every other module lives in a room named for its role.
    loose = {m for m in worker if m.count(".") == 1 and worker_room(m) == m
             and (REPO / "worker" / (m.split(".")[1] + ".py")).exists()}
    assert loose == {"worker.errors", "worker.link", "worker.lifeline", "worker.status",
                     "worker.faults", "worker.__main__"}, loose
