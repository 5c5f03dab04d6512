"""Download progress for `mlxctl pull`: a bar per file and one overall, or JSON lines.

One `Progress` holds the files' sizes and what has arrived; huggingface_hub reports bytes
through a bar class it instantiates per file (`bar_class`), which only forwards here.
Three outputs from the same counts:
- a terminal: a line per file in progress and an overall line, redrawn in place at most
  ~10 times a second (bytes, rate, ETA); each finished file leaves one line above them
  (files the cache already held say `cached`);
- not a terminal: one plain line per finished file;
- `--json`: one object per line for scripts (`start`, `file` at most ~5 a second per file,
  `done`, and the caller's final `complete`).
Rates count the bytes of this run only (not a resumed file's earlier part, nor cached
files), so the ETA is honest after a resume.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from mlxctl.format import human_bytes

REDRAW_S = 0.1
JSON_EVERY_S = 0.2
BAR = 24            # the widest a bar gets; narrower on a narrow terminal
RATE_AFTER_S = 1.0  # a rate over less time is noise (a file's first bytes): none shown


@dataclass
class FileState:
    name: str
    total: int | None
    done: int = 0
    state: str = "waiting"     # waiting | downloading | done | cached
    started: float | None = None
    fresh: int = 0             # bytes that arrived in this run
    last_json: float = 0.0


def bar(fraction: float | None, width: int = BAR) -> str:
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -"
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"ETA {s // 3600}h{s % 3600 // 60:02d}m"
    return f"ETA {s // 60}m{s % 60:02d}s" if s >= 60 else f"ETA {s}s"


def per_second(n: int, seconds: float) -> float | None:
    return n / seconds if n > 0 and seconds >= RATE_AFTER_S else None


def shorten(name: str, width: int) -> str:
    """`name` in `width` columns, cut in the middle: a shard's number is at its start,
    its kind at its end."""
    if len(name) <= width:
        return name.ljust(width)
    head = (width - 1) // 2
    return name[:head] + "…" + name[len(name) - (width - 1 - head):]


class Progress:
    def __init__(self, files: list[tuple[str, int | None]], *, out: TextIO = sys.stderr,
                 tty: bool = False, json_lines: bool = False,
                 clock: Callable[[], float] = time.monotonic, width: int | None = None):
        self.files = {name: FileState(name, size) for name, size in files}
        self.out, self.tty, self.json_lines, self.clock = out, tty, json_lines, clock
        self.width = width
        self.t0 = clock()
        self._drawn = 0           # lines of the live part on screen
        self._finished: list[str] = []   # finished files' lines not printed yet
        self._drawn_at = -1e9

    # ---- what huggingface_hub and the caller report ----------------------------------
    def start(self, name: str, total: int | None = None, initial: int = 0) -> None:
        f = self.files.setdefault(name, FileState(name, total))
        f.total = total if total is not None else f.total
        f.done, f.state, f.started = initial, "downloading", self.clock()
        self._event({"event": "file", "file": name, "bytes": f.done, "total": f.total}, f,
                    force=True)
        self._draw()

    def advance(self, name: str, n: int) -> None:
        f = self.files[name]
        f.done += n
        # huggingface_hub gives bytes back (a negative update) when a server ignored
        # a Range and the file starts over.
        f.fresh = max(0, f.fresh + n)
        self._event({"event": "file", "file": name, "bytes": f.done, "total": f.total}, f)
        self._draw()

    def finish(self, name: str, *, cached: bool = False) -> None:
        f = self.files[name]
        f.state = "cached" if cached else "done"
        if f.total is not None:
            f.done = f.total
        self._event({"event": "done", "file": name, "bytes": f.done, "cached": cached}, f,
                    force=True)
        if self.json_lines:
            return
        if self.tty:
            self._finished.append(self._line(f, self._columns()))
            self._draw(force=True)
        else:
            how = "cached" if cached else human_bytes(f.done)
            self.out.write(f"{name}: {how}\n")
            self.out.flush()

    def begin(self, model: str) -> None:
        if self.json_lines:
            self._write({"event": "start", "model": model, "total_bytes": self.total(),
                         "files": [{"file": f.name, "size": f.total}
                                   for f in self.files.values()]})

    # ---- figures ---------------------------------------------------------------------
    def total(self) -> int | None:
        sizes = [f.total for f in self.files.values()]
        return None if any(s is None for s in sizes) else sum(sizes)

    def done_bytes(self) -> int:
        return sum(f.done for f in self.files.values())

    def rate(self) -> float | None:
        return per_second(sum(f.fresh for f in self.files.values()), self.clock() - self.t0)

    def _columns(self) -> int:
        """The width of the terminal the display goes to (stderr's, not stdout's)."""
        if self.width:
            return self.width
        try:
            columns = os.get_terminal_size(self.out.fileno()).columns
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            columns = 0
        # One column spare: a line as wide as the screen wraps at once on some
        # terminals, and the redraw would then move up too few lines.
        return max(20, (columns or shutil.get_terminal_size((100, 20)).columns) - 1)

    def _layout(self, width: int) -> tuple[int, int]:
        """(name column, bar) widths: the overall line's other fields take ~64 columns."""
        name_w = max(8, min(max((len(n) for n in self.files), default=8), width // 4))
        return name_w, max(10, min(BAR, width - name_w - 64))

    def _line(self, f: FileState, width: int) -> str:
        name_w, bar_w = self._layout(width)
        frac = (f.done / f.total) if f.total else (1.0 if f.state in ("done", "cached")
                                                   else None)
        if f.state == "cached":
            tail = f"{human_bytes(f.total)}  cached"
        else:
            tail = f"{human_bytes(f.done)}/{human_bytes(f.total)}"
            r = per_second(f.fresh, self.clock() - (f.started or self.t0))
            if f.state == "downloading":
                left = (f.total - f.done) / r if r and f.total else None
                tail += f"  {human_bytes(int(r)) + '/s' if r else '-'}  {eta(left)}"
            elif r:
                tail += f"  {human_bytes(int(r))}/s"
        pct = f"{frac:4.0%}" if frac is not None else "   ?"
        return f"{shorten(f.name, name_w)} {bar(frac, bar_w)} {pct}  {tail}"[:width]

    def lines(self) -> list[str]:
        """The live part of a terminal's display: a line per file in progress, then the
        overall line. (A finished file's line is printed once, above it: a repo of many
        shards never makes the live part taller than the screen.)"""
        width = self._columns()
        name_w, bar_w = self._layout(width)
        out = [self._line(f, width) for f in self.files.values() if f.state == "downloading"]
        total, done, r = self.total(), self.done_bytes(), self.rate()
        frac = done / total if total else None
        left = (total - done) / r if r and total is not None else None
        finished = sum(f.state in ("done", "cached") for f in self.files.values())
        out.append((f"{'overall'.ljust(name_w)} {bar(frac, bar_w)} "
                    f"{f'{frac:4.0%}' if frac is not None else '   ?'}  "
                    f"{human_bytes(done)}/{human_bytes(total)}  "
                    f"{human_bytes(int(r)) + '/s' if r else '-'}  {eta(left)}  "
                    f"({finished}/{len(self.files)} files)")[:width])
        return out

    # ---- output ----------------------------------------------------------------------
    def _event(self, obj: dict, f: FileState, force: bool = False) -> None:
        if not self.json_lines:
            return
        now = self.clock()
        if force or now - f.last_json >= JSON_EVERY_S:
            f.last_json = now
            self._write(obj)

    def _write(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.tty or self.json_lines:
            return
        now = self.clock()
        if not force and now - self._drawn_at < REDRAW_S:
            return
        self._drawn_at = now
        lines = self.lines()
        # Back to the live part's first line, clear to the end, print what finished
        # (it stays, scrolling up), then the live part again.
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "\x1b[J" + "".join(line + "\n" for line in self._finished + lines))
        self._finished.clear()
        self.out.flush()
        self._drawn = len(lines)


def bar_class(progress: Progress, name: str):
    """The class huggingface_hub instantiates for one file's progress (its `tqdm_class`:
    a class that is not tqdm's gets only these keywords): it forwards to `progress`."""

    class Bar:
        def __init__(self, *, total=None, initial=0, **_):
            progress.start(name, total, initial)

        def update(self, n=1):
            progress.advance(name, n)

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return Bar
