"""What the model lifecycle tells whoever listens (metrics): requests finished, workers
restarted, models unloaded or refused, swaps. Runners and the pool call these hooks as
things happen; the base class ignores them all, so nothing depends on a listener."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol import Done
    from supervisor.workers.handle import RequestHandle
    from supervisor.workers.runner import ModelRunner


class Observer:
    def request_done(self, runner: "ModelRunner", handle: "RequestHandle", done: "Done") -> None:
        pass

    def worker_restarted(self, runner: "ModelRunner", cause: str) -> None:
        pass

    def model_unloaded(self, runner: "ModelRunner", reason: str) -> None:
        pass

    def model_refused(self, runner: "ModelRunner") -> None:
        pass

    def swapped(self, mode: str, outcome: str, seconds: float) -> None:
        pass
