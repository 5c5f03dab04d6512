"""The memory gate's arithmetic: how much a model needs and whether it fits now.

need = weights on disk × `memory_factor` + `kv_budget` (DESIGN.md). It fits when the OS
reports that much available beyond what loads already admitted but not yet resident will
take (`reserved`), the pressure level is not critical, and, with `--memory-budget`, the
estimates of the resident models plus this one stay within the budget. What to do when it
does not fit (evict, wait, 507) is the pool's loop; this module only judges.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol import models
from supervisor.memory import catalog
from supervisor.config import Config
from supervisor.memory.probe import CRITICAL, MemoryReading, Probe


@dataclass(frozen=True)
class Verdict:
    fits: bool
    need_bytes: int
    free_bytes: int     # what this load could have: available less reservations, or budget left
    reason: str = ""

    def describe(self) -> str:
        gib = 1024 ** 3
        return (f"{self.reason}: need {self.need_bytes / gib:.2f} GiB, "
                f"free {self.free_bytes / gib:.2f} GiB")


class MemoryGate:
    def __init__(self, config: Config, probe: Probe):
        self.config = config
        self.probe = probe

    def need(self, model: str, share: tuple[int, int] = (1, 1)) -> int:
        """Estimated bytes `model` takes on this machine once loaded (blocking: reads the
        disk). `share`: (ranks here, ranks in all) of a worker group, each rank holding
        its part of the weights and a KV budget of its own (each other host is checked by
        its ranks before they load: worker/group/setup.py)."""
        return models.need_bytes(catalog.resolve(model, Path(self.config.state_dir)),
                                 self.config.memory_factor, self.config.kv_budget, share)

    def judge(self, need: int, reading: MemoryReading, *, reserved: int = 0,
              committed: int = 0, ranks_here: int = 1) -> Verdict:
        """`reserved`: bytes admitted loads will still take; `committed`: the estimates of
        every model resident or loading (for the budget); `ranks_here`: a worker group's
        ranks on this machine, which `need` covers together. Where the reading has a GPU
        for each of them (CUDA: rank i on visible GPU i, protocol/hosts.py rank_devices),
        each rank's share is judged against its own GPU (the reserved bytes spread over
        them), so a model larger than one GPU is admitted where the group's GPUs hold it;
        otherwise the ranks share the one memory read."""
        free = max(0, reading.available_bytes - reserved)
        if ranks_here > 1 and len(reading.gpus) >= ranks_here:
            # Each rank needs need / ranks_here: it fits when the least free GPU holds that.
            free = max(0, min(reading.gpus[:ranks_here]) - reserved // ranks_here) * ranks_here
        budget = self.config.memory_budget
        if budget:
            left = max(0, budget - committed)
            if need > left:
                return Verdict(False, need, min(free, left), "over --memory-budget")
            free = min(free, left)
        if reading.pressure == CRITICAL:
            return Verdict(False, need, free, "memory pressure is critical")
        if need > free:
            return Verdict(False, need, free, "not enough available memory")
        return Verdict(True, need, free)
