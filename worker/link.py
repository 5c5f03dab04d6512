"""The worker's ZeroMQ I/O: two threads beside the MLX thread.

- The receiver owns the PULL (commands) socket. It decodes each frame; garbage is logged
  and skipped, never fatal, but a Generate it cannot read whose rid it can still read gets
  its Error and Done at once (the supervisor would wait for it until its request timeout:
  only a supervisor bug or a version mismatch sends one). StatusRequest is answered right here from WorkerStatus, so a
  status answer never waits for a long MLX step. Everything else goes to `commands` for
  the scheduler.
- The sender owns the PUSH (events) socket: ZMQ sockets are not thread-safe, so exactly
  one thread sends. It encodes and sends what the other threads put on `outbound`, and
  sends a Heartbeat every interval even while events are flowing. It keeps beating while
  the MLX thread is stuck in a long step, because MLX evaluation releases the GIL; so a
  heartbeat shows the process is alive, and a `steps` counter that stops advancing while
  busy shows a hang.

Sockets are created in the constructor (so a bad endpoint fails at once, in the caller)
and then used only by their owning thread; starting a thread is a full memory barrier,
which is what ZMQ asks for when a socket changes threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from protocol import (Done, Error, ErrorCode, FinishReason, ProtocolError, StatusRequest,
                      decode_down, encode)
from protocol.codec import unreadable_generate_rid
from protocol import sockets

log = logging.getLogger("worker.link")

# Linger on the events socket: long enough that the last Done leaves on exit, short
# enough that a supervisor that is gone cannot hold the exit up for long.
EVENTS_LINGER_MS = 1000
_POLL_MS = 100      # how often the receiver looks at its stop flag
_STOP = object()    # sentinel on `outbound`: send what came before, then stop


class Link:
    def __init__(self, ctx: zmq.Context, commands_endpoint: str, events_endpoint: str,
                 status, heartbeat_interval: float = 1.0):
        self.status = status
        self.interval = heartbeat_interval
        # SimpleQueue: C-implemented (cheap per token) and its put() is reentrant, so
        # the SIGTERM handler may put a Shutdown while the main thread is in get().
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.outbound: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = ctx
        self._pull = sockets.pull(ctx, commands_endpoint, bind=False)
        self._push = sockets.push(ctx, events_endpoint, bind=False, linger_ms=EVENTS_LINGER_MS)
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._receive_loop, name="link-recv",
                                          daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="link-send", daemon=True)

    def start(self) -> None:
        """Start the threads not started yet (close() calls it too: a SIGTERM handler may
        close the link before, or while, main() starts it)."""
        for thread in (self._receiver, self._sender):
            if thread.ident is None:
                thread.start()

    def send(self, msg) -> None:
        """Queue a message (or already encoded bytes) for the sender thread."""
        self.outbound.put(msg)

    def close(self, timeout: float = 3.0) -> None:
        """Send everything queued so far, stop both threads and flush the sockets."""
        self.start()  # the threads own the sockets: they send what is queued, then close them
        self.outbound.put(_STOP)
        self._sender.join(timeout)
        self._stop.set()
        self._receiver.join(timeout)
        # term() waits (up to the linger) until queued events have left the process.
        if not (self._sender.is_alive() or self._receiver.is_alive()):
            self._ctx.term()

    # ---- threads --------------------------------------------------------------------

    def _receive_loop(self) -> None:
        sock = self._pull
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                data = sock.recv()
                try:
                    msg = decode_down(data)
                except ProtocolError as e:
                    log.warning("dropped an invalid command frame (%d bytes): %s", len(data), e)
                    self._answer_unreadable(data)
                    continue
                if isinstance(msg, StatusRequest):
                    self.outbound.put(self.status.status(msg.qid))
                else:
                    self.commands.put(msg)
        except zmq.ContextTerminated:
            pass
        except Exception:
            # The receiver dying would leave the worker deaf; make that loud in stderr.
            log.exception("command receiver failed")
            raise
        finally:
            sock.close()

    def _answer_unreadable(self, data: bytes) -> None:
        """End a Generate that could not be decoded, if its rid can be read: the
        scheduler never saw it, so this is its one Done."""
        rid = unreadable_generate_rid(data)
        if rid is None:
            return
        epoch = self.status.epoch
        self.outbound.put(Error(epoch=epoch, code=ErrorCode.INTERNAL, rid=rid,
                                message="the worker could not read the request; see the "
                                        "server log"))
        self.outbound.put(Done(epoch=epoch, rid=rid, finish_reason=FinishReason.ERROR))

    def _send_loop(self) -> None:
        sock, q, status, interval = self._push, self.outbound, self.status, self.interval
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    sock.send(encode(status.heartbeat()))
                    next_beat = now + interval
                try:
                    msg = q.get(timeout=next_beat - now)
                except queue.Empty:
                    continue
                if msg is _STOP:
                    break
                try:
                    data = msg if isinstance(msg, bytes) else encode(msg)
                except Exception:  # one bad message must not silence the worker
                    log.exception("could not encode %s", type(msg).__name__)
                    continue
                sock.send(data)
        except Exception:
            log.exception("event sender failed")
            raise
        finally:
            sock.close()  # with linger: the context's term() flushes what is queued
