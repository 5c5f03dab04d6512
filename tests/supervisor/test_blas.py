"""supervisor/workers/blas.py: on Linux a process running MLX starts with the system's
OpenBLAS preloaded (MLX's CPU wheel bundles the reference BLAS); never on macOS, never
over the user's choice, and the spawned worker really gets it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq.asyncio

from supervisor.workers import blas
from supervisor.workers.link import ProcessLink

DEB = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def only(*paths):
    return lambda p: p in paths


def test_linux_finds_the_first_installed_openblas_for_its_architecture():
    assert blas.openblas("linux", "x86_64", only(DEB)) == DEB
    arm = "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas.openblas("linux", "aarch64", only(arm, DEB)) == arm
    assert blas.openblas("linux", "x86_64", only()) is None


def test_macos_keeps_accelerate():
    assert blas.openblas("darwin", "arm64", lambda p: True) is None
    assert blas.preload({}, platform="darwin", machine="arm64", exists=lambda p: True) == {}


@pytest.mark.parametrize("environ, want", [
    ({}, {"LD_PRELOAD": DEB}),
    ({"LD_PRELOAD": "/opt/libfoo.so"}, {"LD_PRELOAD": f"/opt/libfoo.so {DEB}"}),
    ({"LD_PRELOAD": "/opt/libopenblas.so"}, {}),   # the user's own OpenBLAS
    ({"MLXD_BLAS": "bundled"}, {}),                  # switched off
])
def test_preload_adds_to_what_the_user_set_and_respects_them(environ, want):
    assert blas.preload(environ, platform="linux", machine="x86_64", exists=only(DEB)) == want


async def test_the_worker_process_is_spawned_with_it(tmp_path, monkeypatch):
    # A "python" that records its environment instead of running the worker.
    seen = tmp_path / "env"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nenv > {seen}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(blas, "openblas", lambda **_: "/lib/libopenblas-test.so")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MLXD_BLAS", raising=False)
    ctx = zmq.asyncio.Context()
    link = ProcessLink(epoch=1, model="m", name="m", runtime_dir=tmp_path, ctx=ctx,
                       worker_args=[], python=str(fake))
    try:
        await link.start()
        await asyncio.wait_for(link._proc.wait(), 20)
    finally:
        link.close()
        ctx.destroy(linger=0)
    assert "LD_PRELOAD=/lib/libopenblas-test.so" in seen.read_text().splitlines()


@pytest.mark.skipif(blas.openblas() is None, reason="no system OpenBLAS installed")
def test_mlx_multiplies_with_the_preloaded_openblas_and_gets_the_same_numbers():
    code = ("import mlx.core as mx, numpy as np; mx.random.seed(0);"
            "a = mx.random.normal((256, 256)); b = mx.random.normal((256, 256));"
            "np.save('OUT', np.array(a @ b));"
            "print(any('LIB' in l for l in open('/proc/self/maps')))")
    code = code.replace("LIB", os.path.realpath(blas.openblas()))
    runs = {}
    for name, extra in (("bundled", {"MLXD_BLAS": "bundled"}), ("openblas", {})):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLXD_BLAS")}
        env.update(extra)
        env.update(blas.preload(env))
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlxd-blas-{os.getpid()}-{name}.npy"
        r = subprocess.run([sys.executable, "-c", code.replace("OUT", str(out))], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        runs[name] = (r.stdout.strip(), np.load(out))
        out.unlink()
    assert runs["bundled"][0] == "False" and runs["openblas"][0] == "True"
    assert abs(runs["bundled"][1] - runs["openblas"][1]).max() < 1e-3
