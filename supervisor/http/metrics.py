"""`/metrics`: Prometheus text format (prometheus-client).

Counters and histograms are fed as things happen: a middleware counts every HTTP request
by endpoint and status; the runners report each finished request (tokens, time to first
token, inter-token latency from the RequestHandle's timestamps) and each worker restart;
the pool reports unloads, refusals and swaps. Gauges (queue depth, in-flight, memory per
worker, available memory) are read at scrape time from the pool's cached state. One
registry per app, so test apps never share series.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import prometheus_client
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from supervisor.keys import POOL
from supervisor.memory.probe import MemoryReading
from supervisor.workers.observer import Observer
from supervisor.workers.pool import Pool
from supervisor.workers.handle import RequestHandle

# `*_created` series double every counter and no dashboard reads them.
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_EVERY = 0.1  # seconds between two event-loop lag samples
CLIENT_CLOSED = 499  # nginx's code for "the client left before the answer"


@dataclass(frozen=True)
class WorkerSample:
    """One worker's state, copied on the event loop so the scrape thread never reads
    structures the loop is changing."""
    model: str
    state: str
    pid: int | None
    queued: int
    in_flight: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    prompt_cache: object = None  # protocol CacheStats, or None
    kv: object = None            # protocol KVStats, or None
    speculation: object = None   # protocol SpeculationStats, or None


def rss_bytes(pid: int | None) -> int | None:
    if not pid:
        return None
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


class Metrics(Observer):
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mlxd_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "method", "status"], registry=r)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens processed",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("mlxd_generation_tokens", "Tokens generated",
                                         ["model"], registry=r)
        self.ttft = Histogram("mlxd_time_to_first_token_seconds",
                              "Admission to first generated token (queueing included)",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mlxd_inter_token_latency_seconds",
                             "Mean time between generated tokens, one sample per request",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.restarts = Counter("mlxd_worker_restarts", "Worker restarts by cause",
                                ["model", "cause"], registry=r)
        self.unloads = Counter("mlxd_model_unloads", "Models unloaded, by reason",
                               ["reason"], registry=r)
        self.refusals = Counter("mlxd_model_load_refusals",
                                "Loads refused by the memory gate or --max-models", ["model"],
                                registry=r)
        self.swaps = Counter("mlxd_swaps", "Model swaps by mode and outcome",
                             ["mode", "outcome"], registry=r)
        self.swap_seconds = Histogram("mlxd_swap_seconds", "Duration of successful swaps",
                                      buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.loop_lag = Histogram("mlxd_event_loop_lag_seconds",
                                  "How late the event loop ran a timer (sampled every "
                                  f"{LAG_EVERY} s): what every request waits on top",
                                  buckets=LAG_BUCKETS, registry=r)
        self._gauges = _PoolGauges()
        r.register(self._gauges)
        self._scrape = asyncio.Lock()

    # ---- observer: called by runners and the pool ------------------------------------
    def request_done(self, model: str, handle: RequestHandle, done) -> None:
        if done.prompt_tokens:
            self.prompt_tokens.labels(model).inc(done.prompt_tokens)
        if done.completion_tokens:
            self.generation_tokens.labels(model).inc(done.completion_tokens)
        if handle.first_token_at is not None:
            self.ttft.labels(model).observe(handle.first_token_at - handle.created)
            if handle.last_token_at is not None and done.completion_tokens > 1:
                self.itl.labels(model).observe((handle.last_token_at - handle.first_token_at)
                                               / (done.completion_tokens - 1))

    def worker_restarted(self, model: str, cause: str) -> None:
        self.restarts.labels(model, cause).inc()

    def model_unloaded(self, model: str, reason: str) -> None:
        self.unloads.labels(reason).inc()

    def model_refused(self, model: str) -> None:
        self.refusals.labels(model).inc()

    def swapped(self, mode: str, outcome: str, seconds: float) -> None:
        self.swaps.labels(mode, outcome).inc()
        if outcome == "ok":
            self.swap_seconds.observe(seconds)

    # ---- scraping --------------------------------------------------------------------
    async def render(self, pool: Pool) -> bytes:
        samples = [WorkerSample(r.id, r.state, r.link.pid if r.link else None, len(r.queue),
                                len(r.inflight), r.live.active_bytes, r.live.peak_bytes,
                                r.live.prompt_cache, r.live.kv, r.live.speculation)
                   for r in pool.all_runners()]
        async with self._scrape:  # the gauges hold one scrape's samples at a time
            return await asyncio.to_thread(self._render, samples, pool.gate.probe)

    def _render(self, samples: list[WorkerSample], probe) -> bytes:
        self._gauges.samples = samples
        try:
            self._gauges.memory = probe()
        except Exception:
            self._gauges.memory = None
        return prometheus_client.generate_latest(self.registry)


class _PoolGauges:
    """A custom collector: the gauges come from the last scrape's samples."""

    def __init__(self):
        self.samples: list[WorkerSample] = []
        self.memory: MemoryReading | None = None

    def describe(self):
        return []  # values only exist at scrape time

    def collect(self):
        queue = GaugeMetricFamily("mlxd_queue_depth", "Requests waiting for a worker", labels=["model"])
        inflight = GaugeMetricFamily("mlxd_in_flight", "Requests on a worker", labels=["model"])
        up = GaugeMetricFamily("mlxd_worker_state", "1 for the worker's current state",
                               labels=["model", "state"])
        mem = GaugeMetricFamily("mlxd_worker_memory_bytes",
                                "Worker memory: process RSS, MLX active and peak",
                                labels=["model", "kind"])
        for s in self.samples:
            queue.add_metric([s.model], s.queued)
            inflight.add_metric([s.model], s.in_flight)
            up.add_metric([s.model, s.state], 1)
            rss = rss_bytes(s.pid)
            if rss is not None:
                mem.add_metric([s.model, "rss"], rss)
            mem.add_metric([s.model, "mlx_active"], s.mlx_active_bytes)
            mem.add_metric([s.model, "mlx_peak"], s.mlx_peak_bytes)
        yield from (queue, inflight, up, mem)
        yield from self._prompt_cache()
        yield from self._kv()
        yield from self._snapshots()
        yield from self._speculation()
        yield GaugeMetricFamily("mlxd_models_loaded", "Workers resident or loading",
                                value=len(self.samples))
        if self.memory is not None:
            yield GaugeMetricFamily("mlxd_memory_available_bytes",
                                    "Memory the OS reports available",
                                    value=self.memory.available_bytes)
            if self.memory.pressure is not None:
                p = GaugeMetricFamily("mlxd_memory_pressure", "1 for the current pressure level",
                                      labels=["level"])
                p.add_metric([self.memory.pressure], 1)
                yield p


    def _prompt_cache(self):
        """Each worker's prompt-prefix cache. Counted by the worker since it started: a
        restart resets them, which Prometheus' rate() reads as a counter reset."""
        counters = {name: CounterMetricFamily(f"mlxd_prompt_cache_{name}", text, labels=["model"])
                    for name, text in (("hits", "Prompts that reused a cached prefix"),
                                       ("misses", "Prompts that found no cached prefix"),
                                       ("tokens_reused", "Prompt tokens not prefilled thanks to "
                                                         "the cache"),
                                       ("evictions", "Cached prefixes dropped for room"),
                                       ("expirations", "Cached prefixes dropped for age"))}
        held = GaugeMetricFamily("mlxd_prompt_cache_bytes", "KV memory of cached prefixes",
                                 labels=["model"])
        entries = GaugeMetricFamily("mlxd_prompt_cache_entries", "Cached prefixes",
                                    labels=["model"])
        for s in self.samples:
            c = s.prompt_cache
            if c is None:
                continue
            for name, family in counters.items():
                family.add_metric([s.model], getattr(c, name))
            held.add_metric([s.model], c.bytes)
            entries.add_metric([s.model], c.entries)
        yield from (*counters.values(), held, entries)

    def _kv(self):
        """Each worker's KV memory: bytes per token of context (what --kv-bits
        changes) and the tokens the batch and the prompt cache hold now."""
        per = GaugeMetricFamily("mlxd_kv_bytes_per_token", "KV bytes one token of context "
                                "takes (attention keys and values, in the KV format)",
                                labels=["model", "bits"])
        tokens = GaugeMetricFamily("mlxd_kv_tokens_held", "Tokens of context the running "
                                   "sequences and the prompt cache hold now", labels=["model"])
        for s in self.samples:
            if s.kv is not None:
                per.add_metric([s.model, str(s.kv.bits or "full")], s.kv.bytes_per_token)
                tokens.add_metric([s.model], s.kv.tokens)
        yield from (per, tokens)

    def _snapshots(self):
        """Each worker's named KV snapshots by tier (worker/snapshots/): the memory tier
        is the prompt cache (its bytes above), the disk tier its files."""
        def counter(name, text, labels=("model",)):
            return CounterMetricFamily(f"mlxd_kv_snapshot_{name}", text, labels=list(labels))

        hits = counter("hits", "Requests that resumed from a named KV snapshot",
                       ("model", "tier"))
        misses = counter("misses", "Requests naming a KV snapshot no tier held")
        fallbacks = counter("fallbacks", "Snapshots whose tokens did not begin the new prompt "
                            "(the template rewrote history): prefix matching instead")
        evictions = counter("disk_evictions", "Snapshot files dropped for room")
        corrupt = counter("disk_corrupt", "Snapshot files that failed to read and were deleted")
        moved = counter("disk_bytes", "Bytes of snapshot files read and written",
                        ("model", "direction"))
        seconds = counter("disk_seconds", "Seconds spent reading and writing snapshot files",
                          ("model", "direction"))
        held = GaugeMetricFamily("mlxd_kv_snapshots", "Named KV snapshots held, by tier",
                                 labels=["model", "tier"])
        disk = GaugeMetricFamily("mlxd_kv_snapshot_disk_bytes", "Bytes of snapshot files",
                                 labels=["model"])
        for s in self.samples:
            snap = s.prompt_cache.snapshots if s.prompt_cache is not None else None
            if snap is None:
                continue
            m = s.model
            hits.add_metric([m, "ram"], snap.hits_ram)
            hits.add_metric([m, "disk"], snap.hits_disk)
            misses.add_metric([m], snap.misses)
            fallbacks.add_metric([m], snap.fallbacks)
            evictions.add_metric([m], snap.disk_evictions)
            corrupt.add_metric([m], snap.disk_corrupt)
            moved.add_metric([m, "read"], snap.disk_read_bytes)
            moved.add_metric([m, "write"], snap.disk_write_bytes)
            seconds.add_metric([m, "read"], snap.disk_read_seconds)
            seconds.add_metric([m, "write"], snap.disk_write_seconds)
            held.add_metric([m, "ram"], snap.named)
            held.add_metric([m, "disk"], snap.disk_entries)
            disk.add_metric([m], snap.disk_bytes)
        yield from (hits, misses, fallbacks, evictions, corrupt, moved, seconds, held, disk)

    def _speculation(self):
        """Each speculating worker's drafts (worker/speculative/), counted since it
        started, and what they come to: the share accepted, tokens per verification."""
        counters = {name: CounterMetricFamily(f"mlxd_speculative_{name}", text,
                                              labels=["model"])
                    for name, text in (("verifications", "Sequence-steps that verified a "
                                        "draft"),
                                       ("drafted_tokens", "Tokens drafted"),
                                       ("accepted_tokens", "Drafted tokens the model accepted"))}
        rate = GaugeMetricFamily("mlxd_speculative_acceptance_ratio",
                                 "Drafted tokens accepted / drafted, since the worker started",
                                 labels=["model"])
        per = GaugeMetricFamily("mlxd_speculative_tokens_per_verification",
                                "Tokens a verification step yields per sequence (1 + "
                                "accepted drafts), since the worker started", labels=["model"])
        for s in self.samples:
            c = s.speculation
            if c is None:
                continue
            for family, value in zip(counters.values(),
                                     (c.verifications, c.drafted, c.accepted)):
                family.add_metric([s.model], value)
            if c.drafted:
                rate.add_metric([s.model], c.accepted / c.drafted)
            if c.verifications:
                per.add_metric([s.model], 1 + c.accepted / c.verifications)
        yield from (*counters.values(), rate, per)


METRICS = web.AppKey("metrics", Metrics)


def _endpoint(request: web.Request) -> str:
    """The route's pattern, never the raw path (ids in paths would explode the series)."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    if resource is None or getattr(info, "http_exception", None) is not None:
        return "unmatched"
    return resource.canonical


@web.middleware
async def metrics_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: sees the final status, after the error middleware made the envelope."""
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except web.HTTPException as e:
        status = e.status
        raise
    finally:
        request.app[METRICS].requests.labels(_endpoint(request), request.method, str(status)).inc()


async def metrics_handler(request: web.Request) -> web.Response:
    body = await request.app[METRICS].render(request.app[POOL])
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def install(app: web.Application) -> Metrics:
    """Call after errors.install(app): the metrics middleware goes outside it."""
    metrics = app[METRICS] = Metrics()
    app.middlewares.insert(0, metrics_middleware)
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(_lag_sampler)
    return metrics


async def _lag_sampler(app: web.Application):
    """Event-loop lag: a timer asked for LAG_EVERY seconds, and how much later it ran.
    Whatever blocks the loop (a slow handler, a big JSON encode) shows here."""
    loop = asyncio.get_running_loop()
    hist = app[METRICS].loop_lag

    async def sample():
        while True:
            t0 = loop.time()
            await asyncio.sleep(LAG_EVERY)
            hist.observe(max(0.0, loop.time() - t0 - LAG_EVERY))

    task = asyncio.create_task(sample())
    yield
    task.cancel()
