"""Fixtures shared by the supervisor's unit tests."""

from __future__ import annotations

from tests.hfcache import hf_cache  # noqa: F401  (a fixture)
