"""What the worker is doing, shared by the MLX thread (the only writer) and the I/O threads.

The I/O threads answer StatusRequest and send heartbeats from here without ever touching
MLX (MLX state is thread-local to the MLX thread, and a status answer must be instant even
while that thread is inside a long prefill chunk). No lock is needed: the writer replaces
one immutable `View` by a single attribute assignment, and `steps` is a plain int — both
atomic under the GIL, so a reader sees either the old or the new value, never a torn one.
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.messages import CacheStats, Heartbeat, KVStats, SpeculationStats, Status


class View(NamedTuple):
    state: str                 # loading | ready | busy | draining
    active: tuple = ()
    waiting: tuple = ()
    active_bytes: int = 0
    peak_bytes: int = 0
    prompt_cache: CacheStats | None = None
    cache_bytes: int = 0       # MLX's buffer cache
    kv: KVStats | None = None  # the batch's KV memory
    speculation: SpeculationStats | None = None


class WorkerStatus:
    def __init__(self, epoch: int):
        self.epoch = epoch
        self.steps = 0          # prefill chunks + decode steps since start
        self.view = View("loading")
        self.load_progress: float | None = None  # set while a GGUF converts (load thread)
        self.progress: float | None = None       # the running request's, where known
        self.group = None  # a group's leader: its control channel (`silence()`)

    def publish(self, state: str, active=(), waiting=(), active_bytes: int | None = None,
                peak_bytes: int | None = None, prompt_cache: CacheStats | None = None,
                cache_bytes: int | None = None, kv: KVStats | None = None,
                speculation: SpeculationStats | None = None) -> None:
        """None for a figure: keep the last published one."""
        old = self.view
        self.view = View(state, tuple(active), tuple(waiting),
                         old.active_bytes if active_bytes is None else active_bytes,
                         old.peak_bytes if peak_bytes is None else peak_bytes,
                         old.prompt_cache if prompt_cache is None else prompt_cache,
                         old.cache_bytes if cache_bytes is None else cache_bytes,
                         old.kv if kv is None else kv,
                         old.speculation if speculation is None else speculation)

    def status(self, qid: int) -> Status:
        v, steps = self.view, self.steps
        return Status(epoch=self.epoch, qid=qid, state=v.state, active=list(v.active),
                      waiting=list(v.waiting), steps=steps, active_bytes=v.active_bytes,
                      peak_bytes=v.peak_bytes, prompt_cache=v.prompt_cache,
                      progress=self.progress)

    def group_silence(self) -> float | None:
        """A group's leader: seconds since the quietest other rank was heard from."""
        return None if self.group is None else self.group.silence()

    def group_memory(self) -> list:
        if self.group is None:
            return []
        return [(rank, *m) for rank, m in sorted(self.group.memory.items())]

    def heartbeat(self) -> Heartbeat:
        v, steps = self.view, self.steps
        return Heartbeat(epoch=self.epoch, state=v.state, steps=steps, active=len(v.active),
                         waiting=len(v.waiting), active_bytes=v.active_bytes,
                         peak_bytes=v.peak_bytes, cache_bytes=v.cache_bytes,
                         prompt_cache=v.prompt_cache, kv=v.kv,
                         load_progress=self.load_progress if v.state == "loading" else None,
                         progress=self.progress, speculation=v.speculation,
                         group_silence=self.group_silence(),
                         group_memory=self.group_memory())
