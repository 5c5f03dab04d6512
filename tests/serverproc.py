"""The real-server helper of the integration tests, re-exported from bench/serverproc.py
(where it lives so the benchmarks can use it without importing tests/)."""

from bench.serverproc import REPO, ServerProcess, free_port

__all__ = ["REPO", "ServerProcess", "free_port"]
