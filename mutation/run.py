"""`make mutate`: cosmic-ray on the modules that keep promises (mutation/modules.toml),
each against the fast tests that cover it, one module at a time; prints the survivors.

    python -m mutation.run [MODULE_PATH ...]   (default: every module, in the file's order)

Why cosmic-ray: it runs any test command once per mutant, so tests that start real worker
processes work as they do under `make test` (mutmut 3 runs its mutants from a mutants/
copy through its own import hooks, which subprocesses do not see). cosmic-ray writes each
mutant into the module's file, so this runs it on a copy of the working tree (the files
git tracks or would track) in a temporary directory: the tree other work happens in is
never mutated. Each module gets its own session (cosmic-ray init, the operator filter,
the `only` filter, exec), and what survived is printed with its diff.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

REPO = Path(__file__).resolve().parent.parent
MODULES = REPO / "mutation" / "modules.toml"


def copy_tree(dest: Path) -> None:
    """The working tree's files as git sees them (tracked, or untracked and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, listed):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            (dest / src.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / src.relative_to(REPO))


def config_for(module: dict, settings: dict) -> str:
    tests = " ".join(module["tests"])
    command = (f"{sys.executable} -m pytest -x -q -p no:cacheprovider "
               f"-m 'not integration' {tests}")
    ops = ", ".join(f"'{op}'" for op in settings["exclude-operators"])
    return (f"[cosmic-ray]\nmodule-path = '{module['path']}'\n"
            f"timeout = {float(settings['timeout'])}\nexcluded-modules = []\n"
            f'test-command = "{command}"\n'
            f"[cosmic-ray.distributor]\nname = 'local'\n"
            f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{ops}]\n")


def skip_outside(session: Path, only: list[str]) -> None:
    """Mark as skipped the mutants outside the functions `only` names."""
    with use_db(session, WorkDB.Mode.open) as db:
        outside = [item.job_id for item in db.pending_work_items
                   if any(m.definition_name not in only for m in item.mutations)]
        if outside:
            db.set_multiple_results(outside, WorkResult(output="outside `only`",
                                                        worker_outcome=WorkerOutcome.SKIPPED))


def report(session: Path, path: str) -> int:
    """Print the module's counts and each survivor; return the number of survivors."""
    counts: dict[str, int] = {}
    survivors = []
    with use_db(session, WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                kind = "skipped"
            elif result.worker_outcome != WorkerOutcome.NORMAL:
                kind = f"error ({result.worker_outcome})"
            else:
                kind = str(result.test_outcome.value)
            counts[kind] = counts.get(kind, 0) + 1
            if result.worker_outcome == WorkerOutcome.NORMAL and \
                    result.test_outcome == TestOutcome.SURVIVED:
                survivors.append((item.mutations[0], result.diff))
    run = sum(n for k, n in counts.items() if k != "skipped")
    print(f"== {path}: {len(survivors)} survived of {run} mutants run "
          f"({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))})", flush=True)
    for m, diff in sorted(survivors, key=lambda s: s[0].start_pos):
        print(f"-- {path}:{m.start_pos[0]} in {m.definition_name}: {m.operator_name}")
        print("\n".join(line for line in (diff or "").splitlines()
                        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))))
    return len(survivors)


def mutate(module: dict, settings: dict, tree: Path) -> int:
    name = module["path"].replace("/", ".").removesuffix(".py")
    config, session = tree / f"cr-{name}.toml", tree / f"cr-{name}.sqlite"
    config.write_text(config_for(module, settings))
    run = lambda *argv: subprocess.run(argv, cwd=tree, check=True)  # noqa: E731
    bindir = Path(sys.executable).parent
    run(bindir / "cosmic-ray", "init", config.name, session.name)
    run(bindir / "cr-filter-operators", session.name, config.name)
    if module.get("only"):
        skip_outside(session, module["only"])
    run(bindir / "cosmic-ray", "exec", config.name, session.name)
    return report(session, module["path"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="module paths (default: all of them)")
    args = parser.parse_args(argv)
    settings = tomllib.loads(MODULES.read_text())
    modules = settings["module"]
    unknown = set(args.modules) - {m["path"] for m in modules}
    if unknown:
        parser.error(f"not in {MODULES.name}: {', '.join(sorted(unknown))}")
    chosen = [m for m in modules if not args.modules or m["path"] in args.modules]
    totals = {}
    with tempfile.TemporaryDirectory(prefix="mlxd-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for module in chosen:
            totals[module["path"]] = mutate(module, settings, tree)
    print("\nsurvivors per module:")
    for path, n in totals.items():
        print(f"  {n:4d}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
