"""Shared fixtures: tiny random-weight models built at test time (nothing is downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.workers import blas
from tests.realmodel import real_mlx_lm, real_model_dir, real_server, smollm2_gguf  # noqa: F401

# Test processes must never try the network for models.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Workers multiply with the BLAS this process does (supervisor/workers/blas.py), so an
# output computed here in-process equals the one a worker streams: `make test` starts
# pytest with OpenBLAS preloaded where there is one; a bare `pytest` keeps the bundled one.
if "openblas" not in os.environ.get("LD_PRELOAD", ""):
    os.environ.setdefault(blas.ENV, "bundled")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> Path:
    """A float32 qwen2-type model, hidden 64, 2 layers, context 4096."""
    from worker.demos.text import build_model

    return build_model(models_dir / "tiny", "tiny").path


@pytest.fixture(scope="session")
def vision_model(models_dir) -> Path:
    """A float32 Qwen2-VL-type model in mlx-vlm's format, with its processor
    (worker/demos/vision.py)."""
    from worker.demos.vision import build_vision_model

    return build_vision_model(models_dir / "tiny-vision").path


@pytest.fixture(scope="session")
def stt_model(models_dir) -> Path:
    """A float32 Whisper in mlx-audio's format, with its processor (worker/demos/stt.py)."""
    from worker.demos.stt import build_stt_model

    return build_stt_model(models_dir / "tiny-stt").path


@pytest.fixture(scope="session")
def tts_model(models_dir) -> Path:
    """A float32 Pocket TTS in mlx-audio's format, with three voices
    (worker/demos/tts.py)."""
    from worker.demos.tts import build_tts_model

    return build_tts_model(models_dir / "tiny-tts").path


@pytest.fixture(scope="session")
def hybrid_model(models_dir) -> Path:
    """A float32 qwen3_next-type model: GatedDeltaNet (recurrent) layers between attention
    layers, hidden 64, 4 layers: its cache cannot be trimmed."""
    from worker.demos.text import build_model

    return build_model(models_dir / "tiny-hybrid", "tiny-hybrid").path


@pytest.fixture(scope="session")
def family_model(models_dir):
    """family_model(name) -> path of a tiny model with a family's chat template and
    special tokens (tests/families.py: plain ChatML or a real tool-calling format), built
    once per session."""
    from tests.families import FAMILIES
    from worker.demos.text import build_model

    def get(family: str) -> Path:
        return build_model(models_dir / f"tiny-{family}", "tiny",
                           template=FAMILIES[family]).path

    return get


@pytest.fixture(scope="session")
def embed_model(models_dir):
    """embed_model("bert" | "qwen3") -> path of a tiny random embedding model: a BERT with
    a sentence-transformers pipeline (mean pooling, normalised; Matryoshka widths 16, 32,
    64), or a Qwen3 pooled at its last token."""
    from worker.demos.pooling import build_embedding_model

    def get(preset: str = "bert") -> Path:
        return build_embedding_model(models_dir / f"embed-{preset}", preset)

    return get


@pytest.fixture(scope="session")
def reranker_model(models_dir) -> Path:
    """A tiny random causal LM whose name says reranker (so it serves /v1/rerank), with
    "yes" and "no" as single tokens of its vocabulary."""
    from worker.demos.text import build_model

    return build_model(models_dir / "tiny-reranker", "tiny",
                       corpus=("yes no yes no. Yes or no? yes, no", "no yes no yes")).path


@pytest.fixture(scope="session")
def cross_encoder_model(models_dir):
    """cross_encoder_model("xlm-roberta" | "bert") -> path of a tiny random reranker with a
    classification head, saved as transformers saves one (bge-reranker, ms-marco MiniLM)."""
    from worker.demos.pooling import build_cross_encoder

    def get(preset: str = "xlm-roberta") -> Path:
        return build_cross_encoder(models_dir / f"cross-encoder-{preset}", preset)

    return get
