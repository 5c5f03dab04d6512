"""An in-process fake worker that speaks the real protocol (through the real codec).

Supervisor unit tests use it to drive the runner's fault paths fast and without MLX:
modes make it crash mid-stream, hang (no heartbeats, no steps), ignore cancels, or fail
to load. It "generates" `tokens` words per request, one every `step_s` seconds; the other
tasks it answers at once: TOKENIZE gives the prompt's (or the messages' joined contents')
UTF-8 bytes as ids, EMBED and SCORE
one row per input, [length of the input, its index] (SCORE: the length alone).
TRANSCRIBE and SPEAK run step by step like a generation: TRANSCRIBE's steps are the
words' Deltas, then a Transcript (one one-second segment per word; the audio's length in
bytes ÷ 1000 as its duration); SPEAK's are Audio chunks of 0.1 s of a 440 Hz tone at
16 kHz, and a voice not in `voices` is refused as the worker does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import math

from protocol import (TASKS_OF, Audio, Cancel, Delta, Done, Error, Generate, Heartbeat,
                      ModelKind, Pooled, Ready, Segment, Shutdown, Started, Status,
                      StatusRequest, Task, Tokens, Transcript, decode_down, decode_up, encode,
                      pack_floats, pack_ids)
from supervisor.workers.link import LinkClosed, WorkerLink


@dataclass
class FakeBehaviour:
    tokens: int = 5
    step_s: float = 0.01
    load_s: float = 0.0
    start_s: float = 0.0                   # from taking a request to its Started (prefill)
    crash_after_tokens: int | None = None  # exit(1) after this many tokens of a request
    hang_after_tokens: int | None = None   # stop everything (incl. heartbeats)
    ignore_cancel: bool = False
    load_error: str | None = None
    context_length: int = 128
    vocab_size: int = 1000
    heartbeat_s: float = 0.05
    die_after_ready_s: float | None = None  # crash this long after Ready, busy or not
    model_kind: ModelKind = ModelKind.TEXT
    active_bytes: int = 0                   # MLX memory its heartbeats report
    speculation: object = None              # SpeculationStats its heartbeats report
    voices: tuple[str, ...] = ("fable", "onyx")  # a TTS model's


FAKE_RATE = 16000
_TONE = pack_floats([0.25 * math.sin(2 * math.pi * 440 * i / FAKE_RATE)
                     for i in range(FAKE_RATE // 10)])


class FakeWorld:
    """Shared across incarnations: behaviour per epoch and a record of what happened."""

    def __init__(self, behaviour: FakeBehaviour | None = None, per_epoch: dict | None = None):
        self.default = behaviour or FakeBehaviour()
        self.per_epoch = per_epoch or {}
        self.links: list[FakeLink] = []
        self.received: list = []  # every down message, decoded

    def factory(self, model: str):
        def make(epoch: int) -> "FakeLink":
            link = FakeLink(epoch, self.per_epoch.get(epoch, self.default), self)
            self.links.append(link)
            return link
        return make


class FakeLink(WorkerLink):
    def __init__(self, epoch: int, behaviour: FakeBehaviour, world: FakeWorld):
        self.epoch = epoch
        self.pid = 10_000 + epoch
        self.b = behaviour
        self.world = world
        self._down: asyncio.Queue = asyncio.Queue()
        self._up: asyncio.Queue = asyncio.Queue()
        self._exit: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self._cancelled: set[str] = set()
        self.steps = 0
        self.frozen = False
        self.closed = False

    async def start(self) -> None:
        self._exit = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._main()), asyncio.create_task(self._beat())]

    def send(self, msg) -> None:
        if self.closed:
            raise LinkClosed("closed")
        raw = encode(msg)
        self.world.received.append(decode_down(raw))
        self._down.put_nowait(raw)

    def _emit(self, msg) -> None:
        if not self.frozen and not self._exit.done():
            self._up.put_nowait(encode(msg))

    async def recv(self) -> list:
        if self.closed:
            raise LinkClosed("closed")
        frames = [await self._up.get()]
        while not self._up.empty():
            frames.append(self._up.get_nowait())
        return [decode_up(f) for f in frames]

    async def wait(self) -> int:
        return await self._exit

    def _die(self, code: int) -> None:
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(code)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    def terminate(self) -> None:
        self._down.put_nowait(encode(Shutdown()))

    def kill(self) -> None:
        self._die(-9)

    def close(self) -> None:
        self.closed = True

    async def _beat(self) -> None:
        while True:
            self._emit(Heartbeat(epoch=self.epoch, state="ready", steps=self.steps,
                                 active_bytes=self.b.active_bytes,
                                 speculation=self.b.speculation))
            await asyncio.sleep(self.b.heartbeat_s)

    async def _main(self) -> None:
        b = self.b
        await asyncio.sleep(b.load_s)
        if b.load_error:
            self._emit(Error(epoch=self.epoch, code="load_failed", message=b.load_error))
            await asyncio.sleep(0.01)
            self._die(3)
            return
        self._emit(Ready(epoch=self.epoch, model="fake", context_length=b.context_length,
                         pid=self.pid, slots=1, random_weights=True,
                         vocab_size=b.vocab_size, model_kind=b.model_kind,
                         voices=list(b.voices) if b.model_kind is ModelKind.TTS else [],
                         sample_rate=FAKE_RATE,
                         translates=b.model_kind is ModelKind.STT))
        if b.die_after_ready_s is not None:
            asyncio.get_running_loop().call_later(b.die_after_ready_s, self._die, 1)
        pending: list[Generate] = []
        while True:
            msg = decode_down(await self._down.get())
            if isinstance(msg, Shutdown):
                self._die(0)
                return
            if isinstance(msg, StatusRequest):
                self._emit(Status(epoch=self.epoch, qid=msg.qid, state="ready", steps=self.steps))
                continue
            if isinstance(msg, Cancel):
                continue  # nothing running: idempotent no-op
            pending.append(msg)
            while pending:
                await self._run(pending.pop(0), pending)

    async def _run(self, g: Generate, pending: list) -> None:
        b = self.b
        if g.task not in (Task.GENERATE, Task.TRANSCRIBE, Task.SPEAK) or \
                g.task not in TASKS_OF[b.model_kind]:
            self._answer(g)
            return
        if g.task is Task.SPEAK and g.speech.voice not in (None, *b.voices):
            self._emit(Error(epoch=self.epoch, code="invalid_request", rid=g.rid,
                             message=f"Unknown voice; voices: {', '.join(b.voices)}",
                             param="voice"))
            self._emit(Done(epoch=self.epoch, rid=g.rid, finish_reason="error"))
            return
        prompt_tokens = len(g.prompt or "") + sum(len(m.get("content") or "") for m in g.messages or [])
        max_tokens = g.sampling.max_tokens
        if prompt_tokens + (max_tokens or 0) > b.context_length:
            self._emit(Error(epoch=self.epoch, code="context_length_exceeded", rid=g.rid,
                             message="too long", param="messages"))
            self._emit(Done(epoch=self.epoch, rid=g.rid, finish_reason="error"))
            return
        await asyncio.sleep(b.start_s)
        self._emit(Started(epoch=self.epoch, rid=g.rid, prompt_tokens=prompt_tokens))
        limit = b.tokens if max_tokens is None else min(b.tokens, max_tokens)
        n = 0
        while n < limit:
            await asyncio.sleep(b.step_s)
            # Take commands between steps, as the real scheduler does.
            shutdown = None
            while not self._down.empty():
                m = decode_down(self._down.get_nowait())
                if isinstance(m, Cancel):
                    self._cancelled.add(m.rid)
                elif isinstance(m, Generate):
                    pending.append(m)
                elif isinstance(m, Shutdown):
                    self._cancelled.update([g.rid, *(w.rid for w in pending)])
                    shutdown = m
                elif isinstance(m, StatusRequest):
                    self._emit(Status(epoch=self.epoch, qid=m.qid, state="busy", steps=self.steps,
                                      active=[g.rid]))
            for w in list(pending):
                if w.rid in self._cancelled:
                    pending.remove(w)
                    self._emit(Done(epoch=self.epoch, rid=w.rid, finish_reason="cancelled"))
            if shutdown is not None:  # the main loop exits on it after this request
                self._down.put_nowait(encode(shutdown))
            if g.rid in self._cancelled and not b.ignore_cancel:
                self._emit(Done(epoch=self.epoch, rid=g.rid, finish_reason="cancelled",
                                prompt_tokens=prompt_tokens, completion_tokens=n))
                return
            if b.hang_after_tokens is not None and n >= b.hang_after_tokens:
                self.frozen = True
                await asyncio.Event().wait()
            if b.crash_after_tokens is not None and n >= b.crash_after_tokens:
                self._die(1)
                await asyncio.Event().wait()
            self.steps += 1
            n += 1
            if g.task is Task.SPEAK:
                self._emit(Audio(epoch=self.epoch, rid=g.rid, sample_rate=FAKE_RATE, data=_TONE))
            elif g.task is Task.TRANSCRIBE:
                self._emit(Delta(epoch=self.epoch, rid=g.rid, text=f" w{n}"))
            else:
                self._emit(Delta(epoch=self.epoch, rid=g.rid, text=f"w{n} ",
                                 token_ids=pack_ids([n])))
        if g.task is Task.TRANSCRIBE:
            self._emit(Transcript(
                epoch=self.epoch, rid=g.rid, text=" ".join(f"w{i}" for i in range(1, n + 1)),
                language="english", duration=len(g.audio or b"") / 1000,
                segments=[Segment(i - 1.0, float(i), f" w{i}", seek=0, tokens=[i])
                          for i in range(1, n + 1)] if g.speech.segments else []))
        self._emit(Done(epoch=self.epoch, rid=g.rid,
                        finish_reason="length" if limit == max_tokens else "stop",
                        prompt_tokens=prompt_tokens, completion_tokens=n))

    def _answer(self, g: Generate) -> None:
        """A task other than generation: its result and Done at once."""
        if g.task not in TASKS_OF[self.b.model_kind]:
            self._emit(Error(epoch=self.epoch, code="invalid_request", rid=g.rid,
                             message="wrong kind", param="model"))
            self._emit(Done(epoch=self.epoch, rid=g.rid, finish_reason="error"))
            return
        if g.task is Task.TOKENIZE:
            text = g.prompt or "".join(m.get("content") or "" for m in g.messages or [])
            ids = list(text.encode())
            result = Tokens(epoch=self.epoch, rid=g.rid, ids=pack_ids(ids))
        else:
            inputs = g.inputs or []
            rows = [[float(len(text)), float(i)] for i, text in enumerate(inputs)]
            if g.task is Task.SCORE:  # one score per document
                rows = [r[:1] for r in rows]
            result = Pooled(epoch=self.epoch, rid=g.rid, rows=len(rows), dim=len(rows[0]),
                            data=pack_floats([v for r in rows for v in r]))
            ids = [0] * sum(len(t) for t in inputs)
        self._emit(Started(epoch=self.epoch, rid=g.rid, prompt_tokens=len(ids)))
        self._emit(result)
        self._emit(Done(epoch=self.epoch, rid=g.rid, finish_reason="stop",
                        prompt_tokens=len(ids)))
