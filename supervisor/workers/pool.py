"""The resident models: API model id → ModelRunner, and when models come and go.

A model's id in the API is the name it was first loaded by: `demo`, a Hugging Face repo
id, or a path exactly as given; for a path, its last component is accepted as an alias.
A model is one directory, whatever its spelling: every runner is also known by its real
path, and any other name leading there (`/a/./b`, a symlink, `demo`'s directory) is routed
to it, never to a second worker. Responses name the runner's id, as they do for aliases.

- Loading: `add` starts a runner whose first step is `_admit`, the memory gate: the
  model's estimated need against what the OS says is available. Short of memory (or of
  `--max-models` slots) it unloads the least recently used idle model and waits, bounded
  by `--memory-wait`, for the memory to come back; then it refuses with 507.
- Load on request: `get` (what the API handlers call) loads a model a request names if
  `--allow-load-on-request` is on and the name leads, by real path, inside the model roots
  (catalog.model_roots). Anything else is the one 404 `model_not_found`, whatever the
  reason (absent, not a model, outside the roots, an absurd name): a client learns
  nothing about the disk; the reason goes to the log and `rejections` (/admin/status).
  A model loaded on request whose load fails is forgotten once the requests waiting for
  it have their error: no `broken` entry stays behind, and a later request may try again.
  Admin loads (`load`, `swap`, `--model`) may name any local path.
- Keep-alive: a model loaded on request that has been idle `--keep-alive` seconds is
  unloaded. `pinned` models (`--model`, `mlxctl load`, swap targets) stay.
- Swap: load the new model behind the gate, then retire the old one (drain or force).
- Retiring a runner takes it out of routing at once; requests it never started are
  routed again by their model name, so none is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from protocol.model_ref import DEMO, DEMO_RANDOM
from supervisor.memory import catalog
from supervisor.config import Config
from supervisor.workers.errors import (BadRequest, InsufficientMemory, LoadFailed, ModelNotFound,
                                       Overloaded, WorkerError, WorkerFailed)
from supervisor.memory.gate import MemoryGate
from supervisor.memory.probe import CRITICAL, Probe, probe_for
from supervisor.workers.handle import RequestHandle
from supervisor.workers.launch import group_share
from supervisor.workers.observer import Observer
from supervisor.workers.report import Health, HealthReport, runner_report
from supervisor.workers.runner import (BROKEN, DRAIN, FORCE, READY, RESTARTING, STARTING, STOPPED,
                               ModelRunner)

log = logging.getLogger("mlxd.pool")

GATE_POLL_S = 0.25


def aliases(model: str) -> list[str]:
    """Other names a model answers to: a path's last component."""
    try:
        is_path = (model not in (DEMO, DEMO_RANDOM)
                   and (os.sep in model or model.startswith("."))
                   and Path(model).exists())
    except (OSError, ValueError):  # a name the filesystem cannot even look at
        return []
    if is_path:
        base = Path(model.rstrip(os.sep)).name
        return [base] if base and base != model else []
    return []


@dataclass
class SwapResult:
    model: str
    mode: str
    replaced: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"model": self.model, "mode": self.mode, "replaced": self.replaced,
                "seconds": round(self.seconds, 3)}


class Pool:
    def __init__(self, config: Config, factory_for, *, probe: Probe | None = None,
                 observer: Observer | None = None, clock=time.monotonic):
        """`factory_for(model) -> LinkFactory`: how a model's workers are made."""
        self.config = config
        self._factory_for = factory_for
        self._clock = clock
        self.gate = MemoryGate(config, probe or probe_for(config.memory_probe))
        self.observer = observer or Observer()
        self.runners: dict[str, ModelRunner] = {}   # routing: resident and loading models
        self.retiring: set[ModelRunner] = set()     # out of routing, still stopping
        self._aliases: dict[str, str] = {}
        self._real: dict[str, str] = {}    # a routed model's real path → its id
        self.created: dict[str, int] = {}  # for /v1/models
        self.last_refusal: str | None = None
        # Loads a request asked for and did not get, and why: for the admin, not clients.
        self.rejections: collections.deque[dict] = collections.deque(maxlen=20)
        self._watches: set[asyncio.Task] = set()
        self._replaces: dict[ModelRunner, tuple[list[ModelRunner], str]] = {}
        self._admission = asyncio.Lock()   # one load decision at a time
        self._swaps = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._shutting_down = False

    @property
    def admission(self) -> asyncio.Lock:
        """Held by every load while it is admitted: whoever holds it knows no load of any
        model starts meanwhile (deleting a model's files holds it)."""
        return self._admission

    # ---- routing ---------------------------------------------------------------------
    def find(self, name: str) -> ModelRunner | None:
        """The runner by its id or alias: no disk, for names already routed."""
        return self.runners.get(name) or self.runners.get(self._aliases.get(name, ""))

    def at(self, real: str) -> ModelRunner | None:
        """The runner serving the directory whose real path is `real`."""
        return self.runners.get(self._real.get(real, ""))

    async def lookup(self, name: str) -> ModelRunner | None:
        """The runner `name` leads to, by id, alias or real path (stat calls: a thread)."""
        runner = self.find(name)
        if runner is None:
            found = await asyncio.to_thread(catalog.target, name, self.config.state_dir)
            runner = self.find(name) or (self.at(found.real) if found is not None else None)
        return runner

    def roots(self) -> list[Path]:
        return catalog.model_roots(self.config.state_dir, self.config.models_dirs)

    def _resolve(self, name: str, anywhere: bool) -> tuple[catalog.Target | None, str]:
        """(where `name` leads, why a request may not load it: "" if it may). Disk work:
        runs in a thread."""
        found = catalog.target(name, self.config.state_dir)
        return found, catalog.refusal(name, found, None if anywhere else self.roots())

    async def get(self, name: str, *, anywhere: bool = False) -> ModelRunner:
        """The runner for a request's `model`, loading the model if it may be.
        `anywhere`: outside the model roots too (a request the admin's model had
        accepted, routed again). A name already routed costs a dict lookup; any other
        is looked up on disk in a thread, never on the event loop."""
        runner = self.find(name)
        if runner is not None:
            return runner
        found, why = await asyncio.to_thread(self._resolve, name, anywhere)
        # Meanwhile another request may have loaded it (under this or another spelling).
        runner = self.find(name) or (self.at(found.real) if found is not None else None)
        if runner is not None:
            return runner  # another spelling of a loaded model (loading is not routing)
        if self._shutting_down:
            raise WorkerFailed("The server is shutting down.")
        if not why and not self.config.allow_load_on_request:
            why = "--allow-load-on-request is off"
        if why:
            self._reject(name, why)
            raise ModelNotFound(name)
        log.info("loading %s on request (%s)", catalog.shown(name), found.real)
        return self.add(name, target=found, on_request=True)

    def _reject(self, name: str, why: str) -> None:
        log.info("request for model %s not served: %s", catalog.shown(name), why)
        self.rejections.append({"model": catalog.shown(name), "reason": why,
                                "time": int(time.time())})

    def all_runners(self) -> list[ModelRunner]:
        return [*self.runners.values(), *self.retiring]

    def add(self, model: str, *, pinned: bool = False, target: catalog.Target | None = None,
            on_request: bool = False) -> ModelRunner:
        """Start a runner for `model`. Its worker loads `target.load_as` (looked up here
        when not given; a name that leads nowhere is handed over as it is and fails in
        the worker, visibly). `on_request`: forgotten if its load fails."""
        if target is None:
            target = catalog.target(model, self.config.state_dir)
        runner = ModelRunner(model, self.config,
                             self._factory_for(target.load_as if target else model),
                             clock=self._clock, admit=self._admit, observer=self.observer,
                             on_refused=self._on_refused)
        runner.pinned = pinned
        self.runners[model] = runner
        for a in aliases(model):
            self._aliases.setdefault(a, model)
        if target is not None:
            self._real.setdefault(target.real, model)
        self.created[model] = int(time.time())
        runner.start()
        if on_request:
            watch = asyncio.create_task(self._forget_failed_load(runner),
                                        name=f"pool:watch-load:{model[:64]}")
            self._watches.add(watch)
            watch.add_done_callback(self._watches.discard)
        return runner

    async def _forget_failed_load(self, runner: ModelRunner) -> None:
        """A load on request that fails (the worker reported a load error, or crashed
        past the crash budget before it was ready) leaves no `broken` model behind: the
        runner has failed what waited for it; take it out of routing."""
        await runner.wait_loaded()  # ready, or its task ended (refused, broken, stopped)
        if runner.state == BROKEN:
            self._unroute(runner)
            self.created.pop(runner.id, None)
            self._reject(runner.id, f"its load failed: {runner.last_error}")

    def _unroute(self, runner: ModelRunner) -> None:
        if self.runners.get(runner.id) is runner:
            del self.runners[runner.id]
            self._aliases = {a: m for a, m in self._aliases.items() if m != runner.id}
            self._real = {p: m for p, m in self._real.items() if m != runner.id}

    def _on_refused(self, runner: ModelRunner) -> None:
        self.last_refusal = f"{runner.id}: {runner.last_error}"
        self._unroute(runner)
        self._replaces.pop(runner, None)
        self.observer.model_refused(runner.id)

    # ---- the memory gate -------------------------------------------------------------
    async def _admit(self, runner: ModelRunner) -> None:
        """Admit `runner`'s load, unloading idle models (LRU) while it does not fit;
        raise 507 (or 503 with every slot busy) once `--memory-wait` has passed."""
        share = group_share(self.config, runner.id)
        need = await asyncio.to_thread(self.gate.need, runner.id, share)
        deadline = self._clock() + self.config.memory_wait
        async with self._admission:
            while True:
                if not self._slot_free(runner):
                    refusal = Overloaded(
                        f"{self.config.max_models} model(s) are loaded (--max-models) and "
                        f"none is idle; `{runner.id}` cannot be loaded now.", 5)
                    why = "max-models"
                else:
                    reading = await asyncio.to_thread(self.gate.probe)
                    verdict = self.gate.judge(need, reading, reserved=self._reserved(runner),
                                              committed=self._committed(runner),
                                              ranks_here=share[0])
                    if verdict.fits:
                        runner.need_bytes = need
                        self._replaces.pop(runner, None)
                        log.info("model %s admitted: needs %.2f GiB, %.2f GiB free",
                                 runner.id, need / 2**30, verdict.free_bytes / 2**30)
                        return
                    refusal = InsufficientMemory(verdict.need_bytes, verdict.free_bytes)
                    why = "memory"
                    log.info("model %s waits for memory: %s", runner.id, verdict.describe())
                    if not self._eviction_could_help(runner, verdict, reading.pressure):
                        why = ""  # unloading everything would not make room: keep them
                victim, mode, kind = self._victim(runner, why) if why else (None, DRAIN, "")
                if victim is not None:
                    # Shielded: if this load is called off meanwhile, the victim's
                    # retirement still completes rather than stopping half way.
                    await asyncio.shield(self._retire(victim, mode, f"making room for {runner.id}",
                                                      kind=kind))
                    continue  # then look again: the memory may take a moment to come back
                if self._clock() >= deadline:
                    raise refusal
                await asyncio.sleep(GATE_POLL_S)

    def _slot_free(self, runner: ModelRunner) -> bool:
        if not self.config.max_models:
            return True
        others = [r for r in self.runners.values() if r is not runner]
        return len(others) < self.config.max_models

    def _reserved(self, runner: ModelRunner) -> int:
        """Admitted loads whose memory the OS does not show as used yet."""
        return sum(r.need_bytes for r in self.all_runners()
                   if r is not runner and r.state in (STARTING, RESTARTING))

    def _committed(self, runner: ModelRunner) -> int:
        return sum(r.need_bytes for r in self.all_runners() if r is not runner)

    def _eviction_could_help(self, runner: ModelRunner, verdict, pressure: str | None) -> bool:
        """Whether unloading every candidate could make room. Under critical pressure
        any unload helps; otherwise, by the estimates, the bytes must add up."""
        if pressure == CRITICAL:
            return True
        olds, _ = self._replaces.get(runner, ([], DRAIN))
        candidates = {r for r in self.runners.values()
                      if r is not runner and (r.evictable or r in olds)}
        return verdict.free_bytes + sum(r.need_bytes for r in candidates) >= verdict.need_bytes

    def _victim(self, runner: ModelRunner, why: str) -> tuple[ModelRunner | None, str, str]:
        """(model, mode, kind) to unload for `runner`: the models a swap replaces first
        (in the swap's mode, busy or not), then the least recently used idle model."""
        olds, mode = self._replaces.get(runner, ([], DRAIN))
        for old in olds:
            if old in self.runners.values():
                return old, mode, "swap"
        idle = [r for r in self.runners.values() if r is not runner and r.evictable]
        if not idle:
            return None, DRAIN, why
        return min(idle, key=lambda r: r.last_used), DRAIN, why

    # ---- unloading -------------------------------------------------------------------
    async def _retire(self, runner: ModelRunner, mode: str, reason: str, *, kind: str,
                      reroute: bool = True) -> None:
        """Unload `runner`. `kind` (swap, memory, max-models, keep-alive, admin) labels
        the metric; `reason` goes into messages and logs."""
        self._unroute(runner)
        self._replaces.pop(runner, None)
        self.retiring.add(runner)
        try:
            leftovers = await runner.retire(mode, timeout=self.config.shutdown_timeout,
                                            reason=reason)
        finally:
            self.retiring.discard(runner)
        self.observer.model_unloaded(runner.id, kind)
        for h in leftovers:
            await self._reroute(h, runner.id, reroute, anywhere=runner.pinned)

    async def _reroute(self, h: RequestHandle, model: str, reroute: bool, *,
                       anywhere: bool) -> None:
        """A request the retired runner never started: served by whichever runner its
        model names now (loading it again if need be), never dropped silently. A model
        the admin loaded (`anywhere`) may be loaded again wherever it lies: the request
        was accepted for it."""
        if h.finished:
            return
        if h.cancel_requested:
            h.fail(WorkerFailed("The request was cancelled."))
            return
        if not reroute:
            h.fail(WorkerFailed(f"Model `{model}` was stopped; please retry."))
            return
        try:
            (await self.get(model, anywhere=anywhere)).adopt(h)
        except WorkerError as e:
            h.fail(e)

    async def unload(self, name: str, mode: str = DRAIN, reason: str = "unloaded by admin") -> str:
        runner = await self.lookup(name)
        if runner is None:
            raise ModelNotFound(name)
        await self._retire(runner, mode, reason, kind="admin")
        return runner.id

    async def kill(self, name: str, *, restart: bool = True) -> dict:
        """mlxctl kill: hard-cancel everything on the worker; restart it or not."""
        runner = await self.lookup(name)
        if runner is None:
            raise ModelNotFound(name)
        if restart:
            ended = runner.kill()
        else:
            ended = len(runner.inflight)
            await self._retire(runner, FORCE, "killed by admin", kind="admin", reroute=False)
        return {"model": runner.id, "cancelled": ended, "restarted": restart}

    async def load(self, name: str) -> ModelRunner:
        """mlxctl load: load (pinned) and wait until it is ready or refused. The admin
        may name any local path: the model roots bind requests only."""
        runner = await self.lookup(name)
        if runner is None:
            found = await asyncio.to_thread(catalog.target, name, self.config.state_dir)
            if found is None:
                raise ModelNotFound(name)
            runner = self.add(name, pinned=True, target=found)
        runner.pinned = True
        await self._loaded(runner)
        return runner

    async def _loaded(self, runner: ModelRunner) -> None:
        """Wait for a runner's load to end; raise its refusal or load failure."""
        await runner.wait_loaded()
        if runner.refused is not None:
            raise runner.refused
        if runner.state in (BROKEN, STOPPED):
            raise LoadFailed(f"Model `{runner.id}` could not be loaded: {runner.last_error}")

    async def swap(self, name: str, mode: str = DRAIN, replace: list[str] | None = None) -> SwapResult:
        """Load `name` behind the memory gate, then retire the models it replaces (by
        default every other resident model) in `mode`. The old ones keep serving while
        the new one loads, unless the gate needs their memory first."""
        if mode not in (DRAIN, FORCE):
            raise BadRequest("mode must be `drain` or `force`.", "mode")
        t0 = self._clock()
        async with self._swaps:
            new = await self.lookup(name)
            if replace:
                olds = []
                for n in replace:
                    old = await self.lookup(n)
                    if old is None:
                        raise ModelNotFound(n)
                    olds.append(old)
            else:
                olds = [r for r in self.runners.values() if r is not new]
            olds = [o for o in olds if o is not new]
            try:
                if new is None:
                    found = await asyncio.to_thread(catalog.target, name,
                                                    self.config.state_dir)
                    if found is None:
                        raise ModelNotFound(name)
                    new = self.add(name, pinned=True, target=found)
                    # Before its gate runs (no await since add): the gate may retire these.
                    self._replaces[new] = (olds, mode)
                new.pinned = True  # the admin chose it: keep-alive leaves it alone
                await self._loaded(new)
                await asyncio.gather(*(self._retire(o, mode, f"swapped for {new.id}", kind="swap")
                                       for o in olds if o in self.runners.values()))
            except WorkerError:
                self.observer.swapped(mode, "failed", self._clock() - t0)
                raise
            seconds = self._clock() - t0
            self.observer.swapped(mode, "ok", seconds)
            log.info("swapped to %s (%s) in %.2f s, replacing %s", new.id, mode, seconds,
                     ", ".join(o.id for o in olds) or "nothing")
            return SwapResult(new.id, mode, [o.id for o in olds], seconds)

    # ---- keep-alive ------------------------------------------------------------------
    def start(self) -> None:
        if self.config.keep_alive > 0:
            self._reaper = asyncio.create_task(self._reap(), name="pool:keep-alive")

    async def _reap(self) -> None:
        period = min(1.0, self.config.keep_alive / 4)
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            for r in list(self.runners.values()):
                if (not r.pinned and r.evictable
                        and now - r.last_used >= self.config.keep_alive):
                    log.info("model %s idle for %.0f s: unloading (keep-alive)", r.id,
                             now - r.last_used)
                    try:
                        await self._retire(r, DRAIN, "idle past --keep-alive", kind="keep-alive")
                    except Exception:  # the reaper must outlive any one unload
                        log.exception("model %s: keep-alive unload failed", r.id)

    # ---- shutdown --------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Shutdown, first phase: refuse new requests and give the accepted ones up to
        `timeout` seconds to finish. True if everything finished."""
        self._shutting_down = True
        runners = self.all_runners()
        for r in runners:
            r.begin_drain()
        done = await asyncio.gather(*(r.wait_idle(timeout) for r in runners))
        return all(done)

    def begin_shutdown(self) -> None:
        self._shutting_down = True
        for r in self.all_runners():
            r.begin_shutdown()

    async def stop(self) -> None:
        self._shutting_down = True
        for task in [self._reaper, *self._watches]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self.all_runners()))

    # ---- health ----------------------------------------------------------------------
    def health(self) -> HealthReport:
        """Ready while a worker is; idle, not unavailable, while models load on request."""
        workers = [runner_report(r) for r in self.all_runners()]
        routed = [runner_report(r) for r in self.runners.values() if r.state != STOPPED]
        ready = [w for w in routed if w["state"] == READY]
        if not routed:
            reasons = ["no model loaded"]
            if self.last_refusal:
                reasons.append(f"last refused: {self.last_refusal}")
            if self.config.allow_load_on_request and not self._shutting_down:
                return HealthReport(Health.IDLE, (*reasons, "models load on request"), workers)
            return HealthReport(Health.UNAVAILABLE, tuple(reasons), workers)
        if ready:
            state = Health.OK if len(ready) == len(routed) else Health.DEGRADED
            return HealthReport(state, tuple(f"{w['model']}: {w['state']}" for w in routed
                                             if w["state"] != READY), workers)
        reasons = []
        for w in routed:
            why = f"model {w['model']} is {w['state']}"
            if w["last_error"]:
                why += f": {w['last_error']}"
            reasons.append(why)
        return HealthReport(Health.UNAVAILABLE, tuple(reasons), workers)
