"""Fixtures shared by the supervisor's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache that huggingface_hub's lookups use."""
    import huggingface_hub.constants as constants
    import huggingface_hub.utils._cache_manager as manager

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(manager, "HF_HUB_CACHE", str(cache))
    return cache
