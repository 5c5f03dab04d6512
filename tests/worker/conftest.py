"""Fixtures for worker tests: the tiny model in-process, and real worker processes."""

from __future__ import annotations

import pytest

from tests.worker.harness import WorkerProc


@pytest.fixture
def spawn(tmp_path):
    """spawn(model, *extra_args) -> WorkerProc; killed and cleaned up after the test."""
    procs = []

    def _spawn(model, *extra, **kw):
        w = WorkerProc(model, kw.pop("state_dir", tmp_path / "state"), *extra, **kw)
        procs.append(w)
        return w

    yield _spawn
    for w in procs:
        w.close()


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model):
    """The tiny model loaded in this process: (model, tokenizer, context_length)."""
    from worker.loading import models

    loaded = models.load(str(tiny_model), tiny_model.parent)
    return loaded


@pytest.fixture
def engine(tiny_loaded):
    """A fresh TextEngine on the shared tiny model (context 4096, prefill step 64)."""
    from worker.text.engine import TextEngine

    return TextEngine(tiny_loaded.model, tiny_loaded.tokenizer, tiny_loaded.context_length,
                      64, tiny_loaded.vocab_size)


@pytest.fixture(scope="session")
def hybrid_engine(hybrid_model):
    """A TextEngine on the tiny hybrid model (recurrent layers: a cache that cannot be
    trimmed), prefill step 64."""
    from worker.loading import models
    from worker.text.engine import TextEngine

    loaded = models.load(str(hybrid_model), hybrid_model.parent)
    return TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 64,
                      loaded.vocab_size)
