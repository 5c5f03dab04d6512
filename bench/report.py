"""The benchmarks' one output format: a titled table of (measure, value, verdict) rows."""

from __future__ import annotations


def goal(value: float, op: str, target: float) -> str:
    """'goal >= 0.90: PASS' (or MISS) for a measured ratio."""
    ok = value >= target if op == ">=" else value <= target
    return f"goal {op} {target:g}: {'PASS' if ok else 'MISS'}"


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{title}")
    for c0, c1, c2 in rows:
        print(f"  {c0.ljust(w0)}  {c1.ljust(w1)}  {c2}".rstrip())
