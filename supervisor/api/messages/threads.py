"""Anthropic's message threads (the `message-threads-2026-08-12` beta): the server holds a
conversation between turns, so each turn sends only its new messages.

A request with `"thread": {"type": "create"}` is served as any other; its whole
conversation (`system`, `tools`, `messages` and the reply) is then held under the reply's
`id`. `"thread": {"type": "continue", "previous_message_id": id}` sends only the messages
since that reply and leaves `system` and `tools` out: the held conversation is put in
front of them and the request is served as if it had sent everything (the worker's
prefix cache already holds that prompt, so it is not prefilled again). Every other field
(model, max_tokens, tool_choice, thinking, ...) is the turn's own.

Anthropic's SDK (anthropic >= 2.14) threads every `tool_runner` loop and
`client.beta.messages.thread()` on its own; without this the second request of a tool
loop reached mlxd as a conversation opening with a tool result and no tools.

As Anthropic's API does, a thread is best-effort and held in the supervisor's memory only:
it goes after IDLE_S without a turn, when the held conversations pass MAX_BYTES (the
least recently used first) and when mlxd restarts. A `continue` that finds nothing is a
404 `thread_not_found`, on which clients replay the whole conversation with `create`. A
reply can be continued once (`thread_already_continued`), and not while another request
continues it (`thread_continue_in_flight`); a turn that fails leaves its predecessor
continuable. The error codes travel in `error.details.error_code` (errors.py), where the
SDK reads them.
"""

from __future__ import annotations

import enum
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from aiohttp import web

from supervisor.api.fields.params import invalid_type, invalid_value, missing
from supervisor.http.errors import APIError

IDLE_S = 15 * 60               # a thread unused this long is gone (Anthropic: 5 minutes)
MAX_BYTES = 256 * 2**20        # the held conversations, as their JSON sizes add up
MAX_CONTINUED = 4096           # replies remembered as continued (for the 400 that says so)
CREATE_ONLY = ("system", "tools")


class Held(enum.Enum):
    READY = "ready"            # its next turn may continue it
    IN_FLIGHT = "in_flight"    # a turn continuing it is running


@dataclass
class Conversation:
    """A thread's state after one reply: what the next turn's request is put behind."""
    system: object             # as the create request gave them (None: not given)
    tools: object
    messages: list             # Anthropic-shaped, the reply last
    size: int                  # bytes, roughly: the JSON it was given as
    used: float                # clock time of its last turn
    state: Held = Held.READY


class Threads:
    """The held conversations, by the `id` of their last reply. One event loop owns it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, idle_s: float = IDLE_S,
                 max_bytes: int = MAX_BYTES):
        self.clock, self.idle_s, self.max_bytes = clock, idle_s, max_bytes
        self.held: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        self.continued: OrderedDict[str, None] = OrderedDict()
        self.bytes = 0

    def turn(self, body: dict, size: int = 0, *, reserve: bool = True) -> "Turn":
        """The turn `body` (`size` bytes as sent) asks for, its conversation whole in
        `Turn.body`; raises the APIError a bad or unusable `thread` is. `reserve`: hold the
        predecessor in flight until the turn records its reply or closes (count_tokens
        only reads)."""
        thread = body.get("thread")
        if thread is None:
            return Turn(self, body)
        if not isinstance(thread, dict):
            raise invalid_type("thread", "an object", thread)
        kind = thread.get("type")
        if kind == "create":
            return Turn(self, body, size, threaded=True)
        if kind is None:
            raise missing("thread.type")
        if kind != "continue":
            raise invalid_value("thread.type", f"{kind!r}. Expected 'create' or 'continue'.")
        previous = thread.get("previous_message_id")
        if previous is None:
            raise missing("thread.previous_message_id")
        if not isinstance(previous, str) or not previous:
            raise invalid_type("thread.previous_message_id", "a message id", previous)
        for name in CREATE_ONLY:
            if name in body:
                raise invalid_value(name, f"a `continue` takes `{name}` from the thread: "
                                    "leave it out, or replay the conversation with "
                                    "`thread: {\"type\": \"create\"}` to change it.")
        held = self._find(previous, reading=not reserve)
        if reserve:
            held.state = Held.IN_FLIGHT
        new = body.get("messages")
        whole = {k: v for k, v in body.items() if k != "thread"}
        # Not a list: the parser names the client's own `messages` as what is wrong.
        whole["messages"] = held.messages + new if isinstance(new, list) else new
        for name in CREATE_ONLY:
            if getattr(held, name) is not None:
                whole[name] = getattr(held, name)
        return Turn(self, whole, size, threaded=True, previous=previous if reserve else None,
                    held=held)

    def _find(self, previous: str, reading: bool = False) -> Conversation:
        self._expire()
        held = self.held.get(previous)
        if held is None:
            if previous in self.continued:
                raise _error(400, f"The message '{_short(previous)}' has already been "
                             "continued, and a reply is continued once: continue from the "
                             "thread's latest message id.", "thread_already_continued")
            raise _error(404, f"No thread is held for the message '{_short(previous)}' "
                         "(it expired, or mlxd restarted): replay the whole conversation "
                         "with `thread: {\"type\": \"create\"}`.", "thread_not_found")
        if held.state is Held.IN_FLIGHT and not reading:
            raise _error(400, f"Another request is continuing from '{_short(previous)}': "
                         "wait for its reply and continue from that.",
                         "thread_continue_in_flight")
        held.used = self.clock()
        self.held.move_to_end(previous)
        return held

    def _hold(self, message_id: str, conversation: Conversation) -> None:
        self.held[message_id] = conversation
        self.bytes += conversation.size
        self._expire()

    def _drop(self, message_id: str) -> None:
        held = self.held.pop(message_id, None)
        if held is not None:
            self.bytes -= held.size

    def _expire(self) -> None:
        """Least recently used first: those idle past IDLE_S, then while over MAX_BYTES
        (never the newest one alone)."""
        now = self.clock()
        while self.held:
            oldest, held = next(iter(self.held.items()))
            if now - held.used <= self.idle_s and (self.bytes <= self.max_bytes
                                                   or len(self.held) == 1):
                break
            self._drop(oldest)

    def _continued(self, message_id: str) -> None:
        self._drop(message_id)
        self.continued[message_id] = None
        while len(self.continued) > MAX_CONTINUED:
            self.continued.popitem(last=False)


class Turn:
    """One request's part in a thread: `body` is what to serve; `record` holds the reply
    when it is whole, `close` (always) frees the predecessor of a turn that failed."""

    def __init__(self, threads: Threads, body: dict, size: int = 0, *, threaded: bool = False,
                 previous: Optional[str] = None, held: Optional[Conversation] = None):
        self.threads, self.body, self.size, self.threaded = threads, body, size, threaded
        self.previous, self.held = previous, held
        self.recorded = False

    def record(self, message_id: str, reply: list[dict]) -> None:
        """The turn's reply is whole (before the client can read its last event): the
        conversation with it is held under its id, and the predecessor is continued."""
        if not self.threaded or self.recorded:
            return
        self.recorded = True
        body = self.body
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        reply_message = {"role": "assistant", "content": reply}
        base = self.held.size if self.held is not None else 0
        size = base + self.size + len(json.dumps(reply_message, ensure_ascii=False))
        self.threads._hold(message_id, Conversation(
            system=body.get("system"), tools=body.get("tools"),
            messages=[*messages, reply_message], size=size, used=self.threads.clock()))
        if self.previous is not None:
            self.threads._continued(self.previous)

    def close(self) -> None:
        if self.previous is not None and not self.recorded and self.held is not None:
            self.held.state = Held.READY


def _error(status: int, message: str, code: str) -> APIError:
    return APIError(status, message, param="thread.previous_message_id", code=code)


def _short(message_id: str) -> str:
    return message_id if len(message_id) <= 80 else message_id[:80] + "..."


THREADS = web.AppKey("message_threads", Threads)
