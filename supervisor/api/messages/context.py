"""Anthropic's context editing (`context_management.edits`, beta
context-management-2025-06-27), done here as Anthropic's server does it, on the prompt
before it is rendered: the client's history is left as sent.

- `clear_thinking_20251015`: thinking of past assistant turns is dropped but for the last
  `keep: {"type": "thinking_turns", "value": N}` (default 1); `keep: "all"` (what Claude
  Code sends) keeps all.
- `clear_tool_uses_20250919`: once the prompt reaches `trigger` (`input_tokens`, default
  100000, or `tool_uses`), the results of all but the last `keep` tool uses (default 3)
  are replaced by a placeholder, oldest first, sparing `exclude_tools`; with
  `clear_tool_inputs` (true, or a list of tool names) their inputs too; with
  `clear_at_least` nothing is cleared unless that many tokens would go.
Token counts are the worker's own (the TOKENIZE task count_tokens runs), taken only when an
edit could apply; the response reports `context_management.applied_edits` with the tokens
each edit cleared. Edits this server does not know (e.g. server-side `compact_*`) are
skipped and named in X-MLXD-Warning: never a 400 for a field a newer client sends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

from supervisor.api.fields.params import invalid_type

THINKING = "clear_thinking_20251015"
TOOL_USES = "clear_tool_uses_20250919"
CLEARED = "[Tool result cleared by context management to save context.]"
DEFAULT_TRIGGER = {"type": "input_tokens", "value": 100_000}


@dataclass
class Edits:
    given: bool = False                  # the request carried context_management
    edits: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def parse(value) -> Edits:
    if value is None:
        return Edits()
    if not isinstance(value, dict):
        raise invalid_type("context_management", "an object", value)
    edits = value.get("edits") or []
    if not isinstance(edits, list):
        raise invalid_type("context_management.edits", "an array", edits)
    out = Edits(given=True)
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict):
            raise invalid_type(f"context_management.edits[{i}]", "an object", edit)
        kind = edit.get("type")
        (out.edits if kind in (THINKING, TOOL_USES) else out.skipped).append(
            edit if kind in (THINKING, TOOL_USES) else str(kind)[:60])
    return out


Count = Callable[[tuple], Awaitable[int]]


async def apply(parsed, edits: Edits, count: Count):
    """`parsed` (a MessagesRequest) with the edits done; and the applied_edits list.
    `count(messages)` is the prompt's token count with those messages."""
    applied: list[dict] = []
    messages = parsed.messages
    tokens = None
    for edit in edits.edits:
        if edit["type"] == THINKING:
            new, n = _clear_thinking(messages, edit.get("keep"))
            if not n:
                continue
            tokens = tokens if tokens is not None else await count(messages)
            after = await count(new)
            applied.append({"type": THINKING, "cleared_thinking_turns": n,
                            "cleared_input_tokens": max(0, tokens - after)})
            messages, tokens = new, after
            continue
        uses = _tool_uses(messages)
        trigger = edit.get("trigger") or DEFAULT_TRIGGER
        if trigger.get("type") == "tool_uses":
            if len(uses) < _int(trigger.get("value"), 0):
                continue
        else:
            tokens = tokens if tokens is not None else await count(messages)
            if tokens < _int(trigger.get("value"), DEFAULT_TRIGGER["value"]):
                continue
        new, n = _clear_tool_uses(messages, uses, edit)
        if not n:
            continue
        tokens = tokens if tokens is not None else await count(messages)
        after = await count(new)
        least = edit.get("clear_at_least") or {}
        if tokens - after < _int(least.get("value"), 0):
            continue
        applied.append({"type": TOOL_USES, "cleared_tool_uses": n,
                        "cleared_input_tokens": max(0, tokens - after)})
        messages, tokens = new, after
    return replace(parsed, messages=messages), applied


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _clear_thinking(messages: tuple, keep) -> tuple[tuple, int]:
    if keep == "all":
        return messages, 0
    n_keep = _int(keep.get("value"), 1) if isinstance(keep, dict) else 1
    with_thinking = [i for i, m in enumerate(messages) if m.get("reasoning_content")]
    drop = set(with_thinking[:max(0, len(with_thinking) - n_keep)])
    out = tuple({k: v for k, v in m.items() if k != "reasoning_content"} if i in drop else m
                for i, m in enumerate(messages))
    return out, len(drop)


def _tool_uses(messages: tuple) -> list[tuple[str, str]]:
    """(call id, tool name) of every tool use, oldest first."""
    return [(c["id"], c["function"]["name"]) for m in messages
            for c in m.get("tool_calls") or ()]


def _clear_tool_uses(messages: tuple, uses: list, edit: dict) -> tuple[tuple, int]:
    keep = _int((edit.get("keep") or {}).get("value"), 3)
    exclude = set(edit.get("exclude_tools") or ())
    inputs = edit.get("clear_tool_inputs")
    older = uses[:max(0, len(uses) - keep)]
    cleared = {cid for cid, name in older if name not in exclude}
    names = dict(uses)
    if not cleared:
        return messages, 0

    def inputs_cleared(name: str) -> bool:
        return inputs is True or (isinstance(inputs, list) and name in inputs)

    out = []
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") in cleared:
            m = {**m, "content": CLEARED}
        elif m.get("tool_calls") and inputs:
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.dumps({})}}
                if c["id"] in cleared and inputs_cleared(names[c["id"]]) else c
                for c in m["tool_calls"]]}
        out.append(m)
    return tuple(out), len(cleared)
