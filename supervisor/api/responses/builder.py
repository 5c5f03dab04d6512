"""One response as it is generated: its output items and its streaming events.

The same builder serves streaming and non-streaming requests (and replay): feed it what
the worker produced (`text`, `reasoning`, `function_call`), then `finish`; each call
returns the events to send, with a strictly increasing `sequence_number`, and
`response()` is the response object at any moment. Shapes follow OpenAI's spec
(Response, ResponseStreamEvent and its members) and the Open Responses one
(ResponseResource and its streaming events), which clients validate strictly: so every
field either requires is present in every state, with null where nothing is known
(`usage` until the end, `max_tool_calls` and `safety_identifier` unless sent), and an
item the response ended inside (failed, cancelled, or cut off by max_output_tokens: a
tool call included) says `incomplete`, never `completed`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from supervisor.api.chat.shapes import chat_logprobs
from supervisor.api.responses.items import new_id
from supervisor.api.responses.request import ResponsesRequest

if TYPE_CHECKING:
    from supervisor.api.responses.seal import Sealer

TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed", "cancelled": "response.failed"}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class ResponseBuilder:
    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list = field(default_factory=list)
    usage: Optional[dict] = None
    error: Optional[dict] = None
    incomplete_reason: Optional[str] = None
    completed_at: Optional[int] = None
    _seq: int = 0
    _open: Optional[dict] = None  # the output item being streamed into
    # Whether reasoning items carry a summary: the request asked for one
    # (`reasoning.summary`). No model here writes summaries, so the summary is the
    # reasoning itself, in one part beside the `content` that carries it too: a client
    # that reads only summaries (the Vercel AI SDK, OpenAI's own models' way) sees it.
    summaries: Optional[bool] = None
    # With `include: ["reasoning.encrypted_content"]`, the key a reasoning item's text is
    # sealed with when the item is done (seal.py), for a client that keeps no state.
    sealer: Optional["Sealer"] = None

    def _summarised(self) -> bool:
        if self.summaries is None:
            self.summaries = bool(self.req and (self.req.reasoning or {}).get("summary"))
        return self.summaries

    # ---- the object ------------------------------------------------------------------
    def response(self) -> dict:
        r = self.req
        obj = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": ({"reason": self.incomplete_reason}
                                   if self.incomplete_reason else None),
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            # (copied: an event holds the response as it stood when the event was made,
            # however much output follows before it is written)
            "model": self.model, "output": [_copy(item) for item in self.output],
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning or {"effort": None, "summary": None},
            "store": r.store, "background": r.background,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "text": {"format": r.text_format_echo, "verbosity": r.verbosity},
            "tool_choice": r.tool_choice_echo,
            # a FunctionTool's description may be null but not absent (Open Responses)
            "tools": [{"description": None, **t} for t in r.tools_echo],
            "truncation": r.truncation, "metadata": r.metadata,
            "prompt_cache_key": r.prompt_cache_key,
            "presence_penalty": r.presence_penalty or 0.0,
            "frequency_penalty": r.frequency_penalty or 0.0,
            "top_logprobs": r.top_logprobs,
            # The Open Responses schema requires them all. No service tier here; the
            # two after it are echoed, not applied (request.py).
            "service_tier": "default", "max_tool_calls": r.max_tool_calls,
            "safety_identifier": r.safety_identifier,
            "usage": self.usage,  # null until the end (as OpenAI's own examples show)
        }
        if r.user is not None:  # OpenAI's `user` is a string, never null
            obj["user"] = r.user
        if r.conversation is not None:
            obj["conversation"] = {"id": r.conversation}
        return obj

    # ---- events ----------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def queued(self) -> list[dict]:
        self.status = "queued"
        return [self._event("response.queued", response=self.response())]

    def text(self, delta: str, item_id: str | None = None,
             logprobs: list | None = None) -> list[dict]:
        """`logprobs`: the delta's tokens (supervisor.api.output.TokenLogprob), when the
        request included them: on the delta event and on the output_text part."""
        if not delta:
            return []
        events = self._ensure("message", item_id)
        item = self._open
        part = item["content"][0]
        part["text"] += delta
        shown = chat_logprobs(logprobs or ())["content"]  # OpenAI's LogProb, as chat's
        part["logprobs"] = part["logprobs"] + shown  # a new list: events hold the old
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=delta, logprobs=shown))
        return events

    def reasoning(self, delta: str, item_id: str | None = None) -> list[dict]:
        if not delta:
            return []
        events = self._ensure("reasoning", item_id)
        item = self._open
        item["content"][0]["text"] += delta
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=delta))
        if item["summary"]:
            item["summary"][0]["text"] += delta
            events.append(self._event("response.reasoning_summary_text.delta",
                                      item_id=item["id"], output_index=len(self.output) - 1,
                                      summary_index=0, delta=delta))
        return events

    def function_call(self, name: str, arguments: str, call_id: str | None = None,
                      item_id: str | None = None, status: str = "completed",
                      namespace: str | None = None) -> list[dict]:
        """A call, whole (the worker parses calls whole): added, arguments, done. A call
        cut off by max_output_tokens comes the same way, `incomplete`, with its arguments
        as far as they got (not valid JSON). A function of a namespace tool names it."""
        events = self._close()
        item = {"id": item_id or new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call_id or new_id("call"), "name": name, "arguments": ""}
        namespace = namespace or (self.req.namespace_of.get(name) if self.req else None)
        if namespace:
            item["namespace"] = namespace
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=dict(item)))
        if arguments:
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index, delta=arguments))
        item["arguments"] = arguments
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=name, arguments=arguments))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item)))
        return events

    def _ensure(self, kind: str, item_id: str | None = None) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        if kind == "message":
            item = {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id or new_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=_copy(item)))
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=dict(part)))
        if kind == "reasoning" and self._summarised():
            summary = {"type": "summary_text", "text": ""}
            item["summary"].append(summary)
            events.append(self._event("response.reasoning_summary_part.added",
                                      item_id=item["id"], output_index=index, summary_index=0,
                                      part=dict(summary)))
        self._open = item
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        part = item["content"][0]
        events = []
        if item["type"] == "message":
            events.append(self._event("response.output_text.done", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      text=part["text"], logprobs=part["logprobs"]))
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0, part=dict(part)))
            for summary in item["summary"]:
                events.append(self._event("response.reasoning_summary_text.done",
                                          item_id=item["id"], output_index=index,
                                          summary_index=0, text=summary["text"]))
                events.append(self._event("response.reasoning_summary_part.done",
                                          item_id=item["id"], output_index=index,
                                          summary_index=0, part=dict(summary)))
            if self.sealer is not None:
                item["encrypted_content"] = self.sealer.seal_reasoning(part["text"])
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=_copy(item)))
        return events

    def finish(self, status: str, *, usage: dict | None = None, error: dict | None = None,
               incomplete_reason: str | None = None) -> list[dict]:
        """completed | incomplete (max_output_tokens) | failed (error) | cancelled."""
        events = self._close(item_status(status))
        self.status = status
        self.usage = usage
        self.error = error
        self.incomplete_reason = incomplete_reason
        if status == "completed":
            self.completed_at = int(time.time())
        events.append(self._event(TERMINAL_EVENTS[status], response=self.response()))
        return events


def item_status(response_status: str) -> str:
    """The status of the item a response ended inside: only a completed response
    finished it."""
    return "completed" if response_status == "completed" else "incomplete"


def _copy(item: dict) -> dict:
    """An output item as it stands (its parts' lists copied: the builder appends to them)."""
    return {**item, **{key: [dict(p) for p in item[key]]
                       for key in ("content", "summary") if key in item}}


class _Replay(ResponseBuilder):
    """A finished stored response, re-told as the events that produced it."""

    def __init__(self, stored: dict):
        self.stored = stored
        super().__init__(req=None, model=stored.get("model", ""), id=stored["id"],
                         created_at=stored.get("created_at", 0),
                         summaries=any(item.get("summary") for item in stored.get("output") or []
                                       if item.get("type") == "reasoning"))

    def response(self) -> dict:
        obj = {**self.stored, "status": self.status,
               "output": [_copy(item) for item in self.output]}
        if self.status == "in_progress":  # as it looked before it finished
            obj.update(error=None, incomplete_details=None, completed_at=None, usage=None)
        return obj


def replay(stored: dict) -> list[dict]:
    """The streaming events of a finished response, from its stored object (each
    item's text in one delta: the stored object does not keep the original chunking)."""
    b = _Replay(stored)
    events = b.start()
    for item in stored.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            parts = item.get("content") or []
            told = b.text("".join(p.get("text", "") for p in parts), item.get("id"))
            if told:  # the stored logprobs, already in their shown shape
                shown = [t for p in parts for t in p.get("logprobs") or []]
                told[-1]["logprobs"] = b._open["content"][0]["logprobs"] = shown
            events += told
        elif kind == "reasoning":
            events += b.reasoning("".join(p.get("text", "") for p in item.get("content") or []),
                                  item.get("id"))
            if b._open is not None and "encrypted_content" in item:  # (its done event's)
                b._open["encrypted_content"] = item["encrypted_content"]
        elif kind == "function_call":
            events += b.function_call(item["name"], item["arguments"], item.get("call_id"),
                                      item.get("id"), item.get("status") or "completed",
                                      item.get("namespace"))
    events += b._close(item_status(stored["status"]))
    b.output = stored.get("output") or b.output  # the stored items, ids and all
    b.status = stored["status"]
    events.append(b._event(TERMINAL_EVENTS.get(stored["status"], "response.completed"),
                           response=b.response()))
    return events
