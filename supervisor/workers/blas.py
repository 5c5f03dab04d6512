"""The BLAS MLX's CPU backend multiplies with on Linux: the system's OpenBLAS, preloaded.

MLX's Linux CPU wheel (`mlx[cpu]`) bundles the reference BLAS, whose single-threaded
textbook sgemm runs at a few GFLOP/s: measured on a 2-core EPYC, a 1024² float32 matmul
at 7 GFLOP/s against 230 with OpenBLAS, and a 2000-token prefill of SmolLM2-135M in 170 s
against 13 s. The bundled library is loaded by its own hashed name through the wheel's
rpath, so the system's BLAS alternatives cannot replace it; preloading a library that
defines the same `cblas_*` symbols can, because the dynamic linker binds to the first
definition it finds. So, on Linux, a process that will run MLX starts with the system's
OpenBLAS (Debian/Ubuntu: `apt install libopenblas0-pthread`) in LD_PRELOAD when one is
installed. macOS uses Accelerate (and Metal); a CUDA build multiplies on the GPU, and its
CPU stream gains the same. Off with MLXD_BLAS=bundled; an LD_PRELOAD the user set is
left alone.

Worker processes get it in the environment they are spawned with (link.py). A process
that runs MLX in-process gets it too, so that its numbers compare with a worker's: the
benchmarks with a raw engine re-execute themselves once at start (`reexec`); `make test`
starts pytest with it (tests/conftest.py keeps workers on the bundled BLAS when pytest runs
without it).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

ENV = "MLXD_BLAS"
# Where Debian/Ubuntu (any architecture) and Fedora put OpenBLAS, first match wins.
CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def openblas(platform: str = sys.platform, machine: str | None = None,
             exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """The system OpenBLAS to preload on this platform, or None."""
    if not platform.startswith("linux"):
        return None
    arch = machine or os.uname().machine
    for pattern in CANDIDATES:
        path = pattern.format(arch=arch)
        if exists(path):
            return path
    return None


def preload(environ: Mapping[str, str], **probe) -> dict[str, str]:
    """The variables to add to `environ` for a process that runs MLX ({}: none)."""
    if environ.get(ENV, "") == "bundled" or "openblas" in environ.get("LD_PRELOAD", ""):
        return {}
    path = openblas(**probe)
    if path is None:
        return {}
    return {"LD_PRELOAD": " ".join(p for p in (environ.get("LD_PRELOAD", ""), path) if p)}


def reexec() -> None:
    """Re-execute this process with OpenBLAS preloaded when it would be (call it before
    MLX is imported). Once: the new process finds it in LD_PRELOAD."""
    extra = preload(os.environ)
    if extra and getattr(sys, "orig_argv", None):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **extra})


def main(argv: list[str] | None = None) -> None:
    """`python -m supervisor.workers.blas`: the library a worker would preload; with
    --ld-preload, the LD_PRELOAD a process running MLX should start with (the Makefile's
    test and bench targets)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--ld-preload"]:
        print(preload(os.environ).get("LD_PRELOAD", os.environ.get("LD_PRELOAD", "")))
    else:
        print(openblas() or "none: MLX's CPU backend uses the BLAS its wheel bundles")


if __name__ == "__main__":
    main()
