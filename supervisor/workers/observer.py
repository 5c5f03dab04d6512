"""What the model lifecycle tells whoever listens (metrics): requests finished, workers
restarted, models unloaded or refused, swaps. Runners and the pool call these hooks as
things happen; the base class ignores them all, so nothing depends on a listener. A
hook names the model by its id (what a listener labels with), not by its runner: the
runner calls these hooks, so the hooks cannot know the runner's type without a loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol import Done
    from supervisor.workers.handle import RequestHandle


class Observer:
    def request_done(self, model: str, handle: "RequestHandle", done: "Done") -> None:
        pass

    def worker_restarted(self, model: str, cause: str) -> None:
        pass

    def model_unloaded(self, model: str, reason: str) -> None:
        pass

    def model_refused(self, model: str) -> None:
        pass

    def swapped(self, mode: str, outcome: str, seconds: float) -> None:
        pass
