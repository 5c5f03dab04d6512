"""`mlxctl top`: the server's workers live, full screen, refreshed every `--interval`.

One line for the server (status, uptime, memory and pressure, requests running), then a
row per model: kind, state (with a transcription's or a GGUF conversion's progress),
queue, batch occupancy, tokens/s now and over the last minute, MLX active and peak
memory, RSS, prompt-cache hit rate, restarts. "Now" is the rate between two refreshes,
from each worker's `tokens_total`; the minute's mean is the server's own. `q` quits (so
does Ctrl-C); a server that goes away is said on screen and asked again.

The screen is a pure function of two status readings and a width (`render`), which
tests check without a terminal; curses only draws it. Not on a terminal (or with
`--once`), it prints `mlxctl status`'s table once; `--json` prints the status once.
"""

from __future__ import annotations

import json
import os
import sys
import time

from supervisor.admin.token import read_token
from mlxctl.connection import EXIT_OK, Failed, Refused, ServerDown
from mlxctl.format import format_status, human_bytes, human_seconds, table

COLUMNS = ("MODEL", "KIND", "STATE", "QUEUE", "BATCH", "TOK/S", "1M", "MLX ACTIVE",
           "MLX PEAK", "RSS", "CACHE HIT", "RESTARTS")


def live_rates(before: dict | None, after: dict, seconds: float) -> dict[str, float]:
    """Tokens per second per model between two readings (empty without a first)."""
    if before is None or seconds <= 0:
        return {}
    old = {w["model"]: w.get("tokens_total", 0) for w in before.get("workers", [])}
    return {w["model"]: max(0, w.get("tokens_total", 0) - old[w["model"]]) / seconds
            for w in after.get("workers", []) if w["model"] in old}


def _hit_rate(cache: dict | None) -> str:
    if not cache:
        return "-"
    asked = cache.get("hits", 0) + cache.get("misses", 0)
    return f"{100 * cache.get('hits', 0) / asked:.0f}%" if asked else "-"


def _state(w: dict) -> str:
    state = w["state"]
    share = w.get("load_progress") if w.get("load_progress") is not None else w.get("progress")
    return f"{state}({share:.0%})" if share is not None else state


def render(status: dict | None, rates: dict[str, float], width: int,
           error: str | None = None) -> list[str]:
    """The screen's lines, each at most `width` characters."""
    if status is None:
        lines = [f"{error}; retrying" if error else "waiting for the server…"]
    else:
        server, mem = status.get("server") or {}, status.get("memory") or {}
        workers = status.get("workers", [])
        head = f"mlxd {status.get('status', '?')}"
        if server:
            head += f"  up {human_seconds(server.get('uptime_s'))}"
        if mem:
            head += (f"  memory {human_bytes(mem.get('available_bytes'))} free of "
                     f"{human_bytes(mem.get('total_bytes'))}, pressure "
                     f"{mem.get('pressure') or 'n/a'}")
        running = sum(w.get("in_flight", 0) for w in workers)
        head += f"  running {running}  tok/s {sum(rates.values()):.1f}"
        lines = [head]
        if error:
            lines.append(f"(last refresh failed: {error}; retrying)")
        lines.append("")
        rows = [(w["model"], w.get("kind") or "-", _state(w),
                 w.get("waiting", w.get("queued", 0)),
                 f"{w.get('worker_active', 0)}/{w.get('slots', '-')}",
                 f"{rates[w['model']]:.1f}" if w["model"] in rates else "-",
                 f"{w.get('tokens_per_s', 0.0):.1f}",
                 human_bytes(w.get("active_bytes")), human_bytes(w.get("peak_bytes")),
                 human_bytes(w.get("rss_bytes")), _hit_rate(w.get("prompt_cache")),
                 w.get("restarts", 0)) for w in workers]
        lines += table(COLUMNS, rows).splitlines() if rows else ["no model loaded"]
    lines += ["", "q quits"]
    return [line[:width] for line in lines]


def _read(client) -> tuple[dict | None, str | None]:
    """A status reading, or why there is none (in a few words: it goes on screen)."""
    try:
        return client.call("GET", "/admin/status", timeout=5), None
    except ServerDown as e:
        reason = str(e).split(";")[0].rsplit(" (", 1)[-1].rstrip(")")
        return None, f"server not reachable at {client.url} ({reason})"
    except Refused as e:
        # A server started afresh on an emptied state directory has a new token.
        client.token = read_token(client.state_dir)
        return None, str(e)
    except Failed as e:
        return None, f"{e} (HTTP {e.status})"


def _screen(stdscr, client, interval: float) -> None:
    import curses

    curses.curs_set(0)
    stdscr.timeout(int(interval * 1000))
    previous, previous_at, status, rates = None, 0.0, None, {}
    while True:
        fresh, error = _read(client)
        now = time.monotonic()
        if fresh is not None:
            rates = live_rates(previous, fresh, now - previous_at)
            previous, previous_at, status = fresh, now, fresh
        height, width = stdscr.getmaxyx()
        stdscr.erase()
        for y, line in enumerate(render(status, rates, max(width - 1, 1), error)[:height]):
            try:
                stdscr.addstr(y, 0, line)
            except curses.error:   # a terminal resized to nothing mid-draw: next time
                pass
        stdscr.refresh()
        key = stdscr.getch()   # waits up to the interval; a resize wakes it at once
        if key in (ord("q"), ord("Q")):
            return


def cmd_top(args, client, deps) -> int:
    if args.json:
        print(json.dumps(client.call("GET", "/admin/status", timeout=10), indent=2))
        return EXIT_OK
    if args.once or not sys.stdout.isatty():
        print(format_status(client.call("GET", "/admin/status", timeout=10)))
        return EXIT_OK
    client.call("GET", "/admin/status", timeout=10)  # refused or down: say so, no screen
    import curses

    # ncurses takes $LINES/$COLUMNS over the terminal's real size when they are set
    # (some shells and test runners export them, stale after a resize): ask the terminal.
    for name in ("LINES", "COLUMNS"):
        os.environ.pop(name, None)
    try:
        curses.wrapper(_screen, client, args.interval)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def add_parser(add) -> None:
    sp = add("top", cmd_top, "a live view of workers, queues, batches, tokens/s, memory")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    sp.add_argument("--once", action="store_true", help="print the table once and exit")
