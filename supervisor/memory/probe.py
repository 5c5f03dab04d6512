"""What the OS says about memory: available bytes and how hard it is pressed.

A `MemoryReading` is one sample. It comes from a probe: `SystemProbe` asks psutil, plus the
macOS memory-pressure level (`sysctl kern.memorystatus_vm_pressure_level`) or Linux PSI
(`/proc/pressure/memory`) where present; `DeviceProbe` reads the GPU's own memory where
MLX runs on CUDA (models live there, not in host RAM: an H100 has 80 GiB beside 126 GiB of
RAM, and the host reading would admit a model the GPU cannot hold); `FileProbe` reads a
JSON file instead, so the memory gate's decisions can be tested on any OS and in a real
server (the hidden `--memory-probe FILE` flag). The parsers are pure functions over the
tools' text.

Probes may block (a subprocess, a file read): call them from a thread, not the loop.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

log = logging.getLogger("mlxd.memory")

# Pressure levels, worst last. "critical" refuses every load whatever the byte count says:
# the OS is already compressing or swapping, and new weights would make it thrash.
NORMAL, WARN, CRITICAL = "normal", "warn", "critical"
_RANK = {NORMAL: 0, WARN: 1, CRITICAL: 2}

# kern.memorystatus_vm_pressure_level: the kernel's own levels (sys/kern_memorystatus.h).
_MACOS_LEVELS = {1: NORMAL, 2: WARN, 4: CRITICAL}

# Linux PSI, share of the last 10 s that tasks stalled on memory: `some` (at least one
# task) and `full` (all of them). These thresholds are where reclaim visibly costs latency.
PSI_WARN_SOME_PCT = 10.0
PSI_CRITICAL_FULL_PCT = 10.0


@dataclass(frozen=True)
class MemoryReading:
    available_bytes: int
    total_bytes: int
    pressure: str | None = None     # normal | warn | critical; None where the OS has no signal
    source: str = "psutil"
    gpus: tuple[int, ...] = ()      # free bytes of each visible CUDA GPU (a group's ranks')

    def to_dict(self) -> dict:
        return {"available_bytes": self.available_bytes, "total_bytes": self.total_bytes,
                "pressure": self.pressure, "source": self.source}


Probe = Callable[[], MemoryReading]


def worse(a: str | None, b: str | None) -> str | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if _RANK[a] >= _RANK[b] else b


def parse_macos_pressure(text: str) -> str | None:
    """`sysctl kern.memorystatus_vm_pressure_level` (or `sysctl -n ...`) output → level."""
    value = text.strip().rsplit(":", 1)[-1].strip()
    try:
        return _MACOS_LEVELS.get(int(value))
    except ValueError:
        return None


@dataclass(frozen=True)
class PSI:
    some_avg10: float
    full_avg10: float | None


def parse_psi(text: str) -> PSI | None:
    """`/proc/pressure/memory` text → the avg10 percentages (None if unreadable)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for field in rest.split():
            key, _, num = field.partition("=")
            if key == "avg10":
                try:
                    values[kind] = float(num)
                except ValueError:
                    return None
    if "some" not in values:
        return None
    return PSI(values["some"], values.get("full"))


def psi_level(psi: PSI | None) -> str | None:
    if psi is None:
        return None
    if psi.full_avg10 is not None and psi.full_avg10 >= PSI_CRITICAL_FULL_PCT:
        return CRITICAL
    if psi.some_avg10 >= PSI_WARN_SOME_PCT:
        return WARN
    return NORMAL


class SystemProbe:
    """The real readings, each source guarded by platform and failing soft (a missing
    pressure signal is no reason to refuse a load)."""

    PSI_PATH = Path("/proc/pressure/memory")

    def __init__(self, platform: str = sys.platform):
        self.platform = platform

    def __call__(self) -> MemoryReading:
        import psutil

        vm = psutil.virtual_memory()
        return MemoryReading(int(vm.available), int(vm.total), self._pressure(),
                             source=f"psutil+{self.platform}")

    def _pressure(self) -> str | None:
        if self.platform == "darwin":
            try:
                out = subprocess.run(["sysctl", "kern.memorystatus_vm_pressure_level"],
                                     capture_output=True, text=True, timeout=2)
                return parse_macos_pressure(out.stdout) if out.returncode == 0 else None
            except (OSError, subprocess.SubprocessError):
                return None
        if self.platform.startswith("linux"):
            try:
                return psi_level(parse_psi(self.PSI_PATH.read_text()))
            except OSError:  # no PSI in this kernel or container
                return None
        return None


class FileProbe:
    """Readings from a JSON file: `{"available_bytes": N, "total_bytes": M, "pressure":
    "normal", "gpus": [free bytes of each GPU]}`. Keys left out come from the system (no
    `gpus`: none). Read on every call, so a test can
    rewrite it while a load waits for memory."""

    def __init__(self, path: Path, fallback: Probe | None = None):
        self.path = Path(path)
        self.fallback = fallback or SystemProbe()

    def __call__(self) -> MemoryReading:
        base = self.fallback()
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            log.warning("memory probe %s unreadable (%s); using the system's readings",
                        self.path, e)
            return base
        return MemoryReading(int(data.get("available_bytes", base.available_bytes)),
                             int(data.get("total_bytes", base.total_bytes)),
                             data.get("pressure", base.pressure), source=f"file:{self.path}",
                             gpus=tuple(int(v) for v in data.get("gpus") or ()))


# Run in a child process (the supervisor never imports MLX): what MLX's default device is,
# and its memory where it is a CUDA GPU (`mx.device_info()`; Metal's memory is the host's).
DEVICE_SNIPPET = """
import json, mlx.core as mx
gpu = mx.default_device().type == mx.DeviceType.gpu
cuda = gpu and not mx.metal.is_available()
info = mx.device_info() if cuda else {}
gpus = [mx.device_info(mx.Device(mx.gpu, i)) for i in range(mx.device_count(mx.gpu))] \
    if cuda else []
print(json.dumps({"cuda": cuda, "info": {k: v for k, v in info.items()
                                         if isinstance(v, (int, float, str))},
                  "gpus": [int(g.get("free_memory") or g.get("total_memory") or 0)
                           for g in gpus]}))
"""


def parse_gpus(text: str) -> tuple[int, ...]:
    """The snippet's output → each visible GPU's free bytes (() if none or unreadable)."""
    try:
        return tuple(int(v) for v in json.loads(text.strip().splitlines()[-1]).get("gpus") or ())
    except (ValueError, IndexError, TypeError, AttributeError):
        return ()


def parse_device_info(text: str) -> tuple[bool, int, int] | None:
    """The snippet's output → (on CUDA, total bytes, free bytes), or None if unreadable.
    MLX's CUDA device_info names its total `total_memory` (older: `memory_size`) and its
    free memory `free_memory`."""
    try:
        data = json.loads(text.strip().splitlines()[-1])
        info = data.get("info") or {}
        if not data.get("cuda"):
            return False, 0, 0
        total = int(info.get("total_memory") or info.get("memory_size") or 0)
        free = int(info.get("free_memory", total))
    except (ValueError, IndexError, TypeError, AttributeError):
        return None
    return (True, total, free) if total > 0 else None


def _run_snippet() -> str:
    out = subprocess.run([sys.executable, "-c", DEVICE_SNIPPET], capture_output=True,
                         text=True, timeout=60)
    return out.stdout if out.returncode == 0 else ""


class DeviceProbe:
    """The GPU's total and free memory where MLX runs on CUDA, host pressure beside it;
    elsewhere (Metal's unified memory, the CPU backend) `fallback`'s reading. The first
    call finds out which (a child process imports MLX: the supervisor never does); CUDA
    readings are cached for `ttl` seconds, as each costs a process."""

    def __init__(self, fallback: Probe | None = None, run: Callable[[], str] = _run_snippet,
                 ttl: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.fallback = fallback or SystemProbe()
        self._run, self.ttl, self._clock = run, ttl, clock
        self.cuda: bool | None = None     # None: not asked yet
        self._last: tuple[float, MemoryReading] | None = None

    def __call__(self) -> MemoryReading:
        host = self.fallback()
        if self.cuda is False:
            return host
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.ttl:
            return replace(self._last[1], pressure=host.pressure)
        try:
            text = self._run()
            found = parse_device_info(text)
        except (OSError, subprocess.SubprocessError):
            found = None
        if found is None and self.cuda and self._last is not None:
            return replace(self._last[1], pressure=host.pressure)  # a blip: the last one
        if found is None or not found[0]:
            if self.cuda is None:
                log.info("memory gate: reading host memory (%s)", "not a CUDA device"
                         if found is not None else "the device could not be read")
            self.cuda = False if self.cuda is None else self.cuda
            return host
        if self.cuda is None:
            log.info("memory gate: reading the CUDA GPU's memory (%.1f GiB)", found[1] / 2**30)
        self.cuda = True
        reading = MemoryReading(found[2], found[1], host.pressure, source="mlx-cuda",
                                gpus=parse_gpus(text))
        self._last = (now, reading)
        return reading


def probe_for(memory_probe: Path | None) -> Probe:
    return FileProbe(memory_probe) if memory_probe else DeviceProbe()
