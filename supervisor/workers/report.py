"""What /health, `mlxctl status` and the dashboard say of one model's runner, and of the
pool as a whole (`HealthReport`).

Built from what the runner and the worker's last heartbeat hold, never by asking the
worker: a status poll must answer at once while a worker is stuck in a long step. The pool
says what its state is and why; only the HTTP layer (supervisor/api/health.py) turns that
into a status code, so worker management knows nothing of HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgspec

from supervisor.workers.liveness import Liveness
from supervisor.workers.runner import ModelRunner
from supervisor.workers.states import RunnerState


def runner_report(r: ModelRunner) -> dict:
    """One runner as /health and status show it."""
    now = r.clock()
    lv = r.live
    return {
        "model": r.id, "state": r.state.value, "epoch": r.epoch,
        "pid": r.link.pid if r.link else None,
        "context_length": r.context_length, "random_weights": r.random_weights,
        "queued": len(r.queue), "in_flight": len(r.inflight),
        # Accepted and not started, here or on the worker: what --max-queue counts.
        "waiting": r.dispatch.waiting(),
        "worker_active": lv.active, "worker_waiting": lv.waiting, "steps": lv.steps,
        "active_bytes": lv.active_bytes, "peak_bytes": lv.peak_bytes,
        # MLX's buffer cache, and the idle size over which the worker is recycled.
        "cache_bytes": lv.cache_bytes, "memory_limit_bytes": r.memory_limit(),
        "restarts": r.restarts, "restart_causes": dict(r.restart_causes),
        "last_error": r.last_error,
        "uptime_s": round(now - r.ready_at, 1) if r.ready_at else None,
        "pinned": r.pinned, "need_bytes": r.need_bytes,
        # A worker group (worker/group/): its ranks, hosts, memory and link; None: one
        # process.
        "group": live_group(r.group, lv),
        "idle_s": round(now - r.last_used, 1) if r.is_idle() else 0.0,
        "tokens_per_s": round(r.tokens.per_second(now, r.ready_at), 2),
        # Every completion token since this runner began: the dashboard's live chart
        # takes the rate between two polls from it (tokens_per_s is a minute's mean).
        "tokens_total": r.tokens.total,
        "slots": r.dispatch.slots,
        # What the model does (text | vision | embed | rerank | stt | tts), once a
        # worker was ready.
        "kind": r.kind,
        "dimensions": r.dimensions,
        "voices": r.voices or None,
        # The running request's share done, where known (a transcription's audio).
        "progress": lv.progress,
        # While a GGUF converts at load: the share done (None otherwise).
        "load_progress": (lv.load_progress
                          if r.state in (RunnerState.STARTING, RunnerState.RESTARTING)
                          else None),
        # The worker's prompt-prefix cache, as its last heartbeat said (None: none).
        "prompt_cache": msgspec.to_builtins(lv.prompt_cache) if lv.prompt_cache else None,
        # Its KV memory: format (bits 0: full precision), bytes per token, held now.
        "kv": msgspec.to_builtins(lv.kv) if lv.kv else None,
        # Its speculative decoding since it started (None: it does not speculate).
        "speculation": speculation(lv.speculation),
    }


def speculation(s) -> dict | None:
    """SpeculationStats with what they mean: the share of drafted tokens accepted and the
    tokens a verification step yields (its pending token and the accepted drafts)."""
    if s is None:
        return None
    return {**msgspec.to_builtins(s),
            "acceptance": round(s.accepted / s.drafted, 3) if s.drafted else None,
            "tokens_per_verification": round(1 + s.accepted / s.verifications, 2)
            if s.verifications else None}


def live_group(group: dict | None, live: Liveness) -> dict | None:
    """Ready.group with each rank's MLX memory as the last heartbeat said (the leader's
    own, and the others' from their beats)."""
    if group is None:
        return None
    memory = {0: (live.active_bytes, live.peak_bytes)}
    memory.update({rank: (active, peak) for rank, active, peak in live.group_memory})
    ranks = []
    for r in group["ranks"]:
        active, peak = memory.get(r["rank"], (r["active_bytes"], r["peak_bytes"]))
        ranks.append({**r, "active_bytes": active, "peak_bytes": peak})
    return {**group, "ranks": ranks}


class Health(str, Enum):
    """The server's state as /health and `mlxctl status` say it."""
    OK = "ok"                    # every routed model is ready
    DEGRADED = "degraded"        # some serve, others load or are broken (or a part is down)
    IDLE = "idle"                # no model loaded, and models load on request
    UNAVAILABLE = "unavailable"  # nothing serves, and nothing will by itself

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class HealthReport:
    """The pool's health: its state, why (each reason a clause of `reason`), and every
    runner's report."""
    state: Health
    reasons: tuple[str, ...] = ()
    workers: list[dict] = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        return "; ".join(self.reasons) or None
