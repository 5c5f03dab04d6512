"""`mlxctl`: administer a running mlxd.

    mlxctl status [--json]      workers, their state and load (from /health)
    mlxctl serve [MLXD FLAGS]   run the server in the foreground (same as `mlxd`)

The server is found through --url or MLXD_URL (default http://127.0.0.1:8080).
Exit codes: 0 ok, 1 the server answered but is not healthy, 2 usage error,
3 the server is not running (or not reachable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8080"
EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3


class ServerDown(Exception):
    pass


def get_json(url: str, path: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.load(e)
        except ValueError:
            return e.code, {}
    except (urllib.error.URLError, OSError) as e:
        raise ServerDown(f"mlxd is not running at {url} ({getattr(e, 'reason', e)}); "
                         "start it with `mlxctl serve --model MODEL` or `mlxctl service start`") from None


def _mib(n) -> str:
    return f"{n / 2**20:.0f} MiB" if n else "-"


def format_status(body: dict) -> str:
    rows = [("MODEL", "STATE", "PID", "UPTIME", "QUEUED", "IN-FLIGHT", "RESTARTS", "MLX MEM")]
    for w in body.get("workers", []):
        rows.append((w["model"], w["state"], str(w.get("pid") or "-"),
                     f"{w['uptime_s']:.0f}s" if w.get("uptime_s") is not None else "-",
                     str(w.get("queued", 0)), str(w.get("in_flight", 0)),
                     str(w.get("restarts", 0)), _mib(w.get("active_bytes"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    head = f"status: {body.get('status', '?')}"
    if body.get("reason"):
        head += f" ({body['reason']})"
    return "\n".join([head, *lines])


def cmd_status(args) -> int:
    code, body = get_json(args.url, "/health")
    print(json.dumps(body, indent=2) if args.json else format_status(body))
    return EXIT_OK if code == 200 else EXIT_UNHEALTHY


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to mlxd
        from supervisor.cli import main as serve_main
        serve_main(argv[1:])
        return EXIT_OK
    p = argparse.ArgumentParser(prog="mlxctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("MLXD_URL", DEFAULT_URL))
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="workers and their state")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
    sub.add_parser("serve", help="run the server in the foreground (flags as mlxd)")
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ServerDown as e:
        print(f"mlxctl: {e}", file=sys.stderr)
        return EXIT_DOWN


def run() -> None:
    """Console-script entry: exit with main()'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
