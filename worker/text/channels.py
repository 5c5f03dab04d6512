"""Split a model's decoded text into the answer, its reasoning, and tool calls.

Text moves between states on the family's markers, matched on decoded text by mlx-lm's
own `TextStateMachine` (robust to how a marker happens to be tokenized; it holds back a
possible partial marker and strips the markers it matches):

    normal --think_start--> reasoning --think_end--> normal   (a repeated think_start
                                                                is stripped in reasoning)
    normal/reasoning --tool_call_start--> tool --tool_call_end--> normal

Text in "tool" is collected per call and parsed, when the call's end marker arrives,
with the family's parser (worker/text/tool_formats.py) into ToolCall items. Calls are sent
whole: an OpenAI stream may carry a call's arguments in one fragment. Their arguments are
the model's own JSON text where it wrote JSON (tool_formats.arguments_text), never
re-serialised. Markup never reaches the answer; a call that does not parse (a model's
malformed output, or arguments no strict JSON parser takes, such as a number beyond a
double) is logged and dropped, as mlx-lm's server does. A call the output was cut off
inside (max_tokens) is not a call, but it is what the tokens were spent on: `finish(cut=
True)` keeps what can be read of it as `cut_call` (name and arguments so far), which the
Responses API shows as an incomplete function_call item.

Llama 3 marks nothing: an answer that starts with "{" is held back and, at the end,
is a call if it parses as one, else plain text.
"""

from __future__ import annotations

import json
import logging
import secrets

from mlx_lm.generate import TextStateMachine

from protocol.messages import ToolCall
from worker.text.tool_formats import ToolFormat, cut_call, normalize_calls

log = logging.getLogger("worker.text.channels")

NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"
_EMPTY: tuple = ()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class OutputSplitter:
    __slots__ = ("_sm", "_state", "_fmt", "_tools", "_tool_text", "_calls", "_markerless",
                 "_held", "_seen_answer", "_gap", "cut_call")

    def __init__(self, tokenizer, fmt: ToolFormat | None, tools: list | None,
                 initial: str = NORMAL):
        """`fmt` None: tool markup is not parsed (no tools, or tool_choice "none")."""
        transitions: dict[str, list] = {}
        if tokenizer.has_thinking:
            transitions[NORMAL] = [(tokenizer.think_start, REASONING)]
            # A second opening tag inside reasoning is markup too: a template that opens
            # the block itself and a model that writes its own tag as well (Qwen3's
            # thinking checkpoints do) would show "<think>" to the reader.
            transitions[REASONING] = [(tokenizer.think_end, NORMAL),
                                      (tokenizer.think_start, REASONING)]
        self._markerless = fmt is not None and not fmt.start
        if fmt is not None and fmt.start:
            transitions.setdefault(NORMAL, []).append((fmt.start, TOOL))
            transitions.setdefault(REASONING, []).append((fmt.start, TOOL))
            transitions[TOOL] = [(fmt.end, NORMAL)] if fmt.end else []
        self._sm = TextStateMachine(transitions or None)
        self._state = self._sm.make_state(initial if initial in transitions else NORMAL)
        self._fmt = fmt
        self._tools = tools
        self._tool_text = ""
        self._calls = 0
        self._held = ""           # markerless: an answer that may be a JSON call
        self._seen_answer = False
        self._gap = ""            # whitespace after a call: kept only if text follows
        self.cut_call: ToolCall | None = None  # the call the output ended inside (finish)

    @property
    def reasoning(self) -> bool:
        """Whether the text being produced now is reasoning."""
        return self._state[0] == REASONING

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> tuple[str, str, tuple]:
        """(answer text, reasoning text, ToolCalls) released by this segment."""
        self._state, segments = self._sm.split(self._state, text)
        return self._route(segments)

    def finish(self, cut: bool = False) -> tuple[str, str, tuple]:
        """At the end: release held text; a call without its end marker is parsed if
        the format has no end marker (Mistral), else dropped; with `cut` (the output
        ran out of tokens) what can be read of it is kept as `cut_call`."""
        in_call = self._state[0] == TOOL
        self._state, tail, state = self._sm.flush(self._state)
        content, reasoning, calls = self._route([(state, tail)])
        unended = self._fmt is not None and not self._fmt.end  # Mistral: parse what came
        parsed = self._parse(self._tool_text, quiet=cut) if self._tool_text and unended else ()
        calls += parsed
        if cut and not parsed and (in_call or self._tool_text.strip()):
            name, arguments = cut_call(self._tool_text.strip())
            self.cut_call = ToolCall(self._calls, new_call_id(), name, arguments)
        elif self._tool_text.strip() and not unended:
            log.warning("dropped an unfinished tool call (%d chars)", len(self._tool_text))
        self._tool_text = ""
        self._gap = ""  # whitespace after the last call is the calls' layout, not text
        if self._held:
            held, self._held = self._held, ""
            parsed = self._parse(held, quiet=True)
            if parsed:
                calls += parsed
            else:
                content += held
        return content, reasoning, calls

    # ---- internals ----------------------------------------------------------------

    def _route(self, segments) -> tuple[str, str, tuple]:
        content = reasoning = ""
        calls: tuple = _EMPTY
        last = len(segments) - 1
        for i, (state, text) in enumerate(segments):
            if state == TOOL:
                self._tool_text += text
                if i < last:  # the end marker came: one call section is complete
                    calls += self._parse(self._tool_text)
                    self._tool_text = ""
            elif state == REASONING:
                reasoning += text
            elif text:
                if self._calls:
                    # The newlines between and after calls are layout, not an answer.
                    if text.isspace():
                        self._gap += text
                        continue
                    text, self._gap = self._gap + text, ""
                content += text
        if self._markerless and content:
            content = self._hold_json(content)
        return content, reasoning, calls

    def _hold_json(self, content: str) -> str:
        """Llama 3: hold back an answer that starts with "{" (it may be a call)."""
        if self._held:
            self._held += content
            return ""
        if not self._seen_answer:
            stripped = content.lstrip()
            if not stripped:
                return content
            self._seen_answer = True
            if stripped.startswith("{"):
                self._held = content
                return ""
        return content

    def _parse(self, text: str, quiet: bool = False) -> tuple:
        text = text.strip()
        try:
            parsed = normalize_calls(self._fmt.parse(text, self._tools), text)
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError, OverflowError,
                json.JSONDecodeError) as e:
            if not quiet:
                log.warning("dropped a tool call that does not parse (%s: %s)",
                            type(e).__name__, str(e)[:200])
            return _EMPTY
        out = []
        for c in parsed:
            out.append(ToolCall(self._calls, c["id"] or new_call_id(), c["name"],
                                c["arguments"]))
            self._calls += 1
        return tuple(out)
