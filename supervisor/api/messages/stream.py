"""A Messages stream: Anthropic's named events, in its order.

    message_start → (content_block_start → content_block_delta… → content_block_stop)…
    → message_delta (stop_reason, stop_sequence, usage) → message_stop

with `ping` events while the model is quiet (a long prefill). Blocks open and close as
the output changes kind: reasoning is a `thinking` block (`thinking_delta`s, then its
`signature_delta` just before it closes), answer text a `text` block (`text_delta`s), and
each tool call a `tool_use` block whose input arrives as `input_json_delta` fragments
(the worker hands over a call whole; it is cut into fragments so clients that assemble
them, as Anthropic's SDK does, see what Anthropic sends); a call the output ran out of
tokens inside is the last block, its input the partial JSON the model wrote (shapes.py).
A failure after the first event ends the stream with an `error` event (http/errors.py
renders it in this API's shape).
"""

from __future__ import annotations

from supervisor.api.messages import shapes
from supervisor.http import sse

FRAGMENT_CHARS = 64  # input_json_delta pieces


class BlockWriter:
    """The events of one message's content blocks, given its output Part by Part; `blocks`
    is the content they add up to (what a message thread holds: threads.py)."""

    def __init__(self, cut_name: str = ""):
        self.cut_name = cut_name          # what a cut call without a name names (only_tool)
        self.index = -1
        self.open: str | None = None      # "thinking" | "text" | None: blocks[-1]'s kind
        self.blocks: list[dict] = []

    def part(self, part) -> list[bytes]:
        out = []
        if part.reasoning:
            out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += part.reasoning
            out.append(self._delta({"type": "thinking_delta", "thinking": part.reasoning}))
        if part.text:
            out += self._ensure("text", {"type": "text", "text": ""})
            self.blocks[-1]["text"] += part.text
            out.append(self._delta({"type": "text_delta", "text": part.text}))
        for call in part.tool_calls:
            out += self._tool_use(call, shapes.tool_input_json(call.arguments), cut=False)
        cut = shapes.named(part.cut_call, self.cut_name)
        if cut is not None:
            out += self._tool_use(cut, cut.arguments, cut=True)
        return out

    def _tool_use(self, call, args: str, cut: bool) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.blocks.append(shapes.tool_use_block(call, cut=cut))
        out.append(event("content_block_start", {
            "type": "content_block_start", "index": self.index,
            "content_block": {"type": "tool_use", "id": call.id, "name": call.name,
                              "input": {}}}))
        for i in range(0, len(args), FRAGMENT_CHARS):
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": args[i:i + FRAGMENT_CHARS]}))
        out.append(event("content_block_stop", {"type": "content_block_stop",
                                                "index": self.index}))
        return out

    def finish(self) -> list[bytes]:
        return self._close()

    def _ensure(self, kind: str, block: dict) -> list[bytes]:
        if self.open == kind:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        self.blocks.append(dict(block))
        out.append(event("content_block_start", {"type": "content_block_start",
                                                 "index": self.index, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            block = self.blocks[-1]
            block["signature"] = shapes.signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        out.append(event("content_block_stop", {"type": "content_block_stop",
                                                "index": self.index}))
        self.open = None
        return out

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta",
                                             "index": self.index, "delta": delta})


def event(name: str, data: dict) -> bytes:
    return sse.encode_event(data, event=name)


PING = event("ping", {"type": "ping"})
