"""Grammar-constrained decoding with llguidance: JSON mode, JSON schema, forced tool calls.

`Grammars` (one per engine) turns a request's OutputSpec into a Lark grammar and a
`Constraint`:
- response_format json_object / json_schema → the JSON (whitespace bounded, numbers
  finite as doubles: worker/text/json_grammar.py);
- tool_choice "required" / a named function → one or more calls written in the model
  family's own call format (tool_formats), so the family's parser reads them back;
- tool_choice "auto" with a JSON response_format → either;
- a thinking model may think first (`<think>…</think>`), then the constrained part.
Compiling (limits, time budget, cache) is worker/text/grammar_compile.py's job.

A `Constraint` wraps one llguidance LLMatcher. Per decode step: `mask()` computes the
allowed-token bitmask (native code, GIL released, so it overlaps the MLX forward pass
running on MLX's own threads) and `consume(token)` advances it. When the grammar is
complete the matcher stops: only EOS remains allowed, and the engine ends the sequence
there without asking the model (whose EOS logit may be anything). A grammar that runs
out of llguidance's per-step budget, or cannot go on (a schema with only infinite
words), raises GrammarError mid-decode: a request error, never the worker's.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Optional

import mlx.core as mx
import numpy as np

from protocol.messages import OutputSpec
from worker.text.grammar_compile import Compiler, GrammarError, clean
from worker.text import json_grammar
from worker.text.json_grammar import json_rule
from worker.text.tool_formats import ToolFormat

log = logging.getLogger("worker.text.constraints")


class Constraint:
    """One request's grammar state. Not thread-safe: made by the preparation thread, then
    used by the MLX thread only."""
    __slots__ = ("matcher", "param", "_bitmask", "_vocab", "_fill")

    def __init__(self, matcher, vocab_size: int, param: str = "response_format"):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self.matcher = matcher
        self.param = param                # what a failure names: response_format or tool_choice
        self._vocab = vocab_size
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._fill = fill_next_token_bitmask

    def allowed(self) -> np.ndarray:
        """The allowed tokens of the next step, as a boolean (vocab,) numpy array."""
        self._fill(self.matcher, self._bitmask)
        if self.matcher.is_error():  # out of per-step fuel, or no way to go on
            raise self._failure()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[:self._vocab].astype(np.bool_)

    def mask(self) -> mx.array:
        """allowed() as an MLX array (MLX thread only)."""
        return mx.array(self.allowed())

    def consume(self, token: int) -> None:
        """Advance by the sampled token. Raises GrammarError if the grammar cannot take it
        (it had allowed it: the grammar hit a limit on the way)."""
        if not self.matcher.consume_token(token):
            raise self._failure()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing but EOS."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def _failure(self) -> GrammarError:
        return GrammarError(f"the output could not follow the {self.param} grammar: "
                            f"{clean(self.matcher.get_error())}", self.param)


class Grammars:
    """Builds Constraints for one model; the llguidance tokenizer is made once, lazily."""

    def __init__(self, tokenizer, vocab_size: int, tool_format: Optional[ToolFormat]):
        self.tokenizer = tokenizer        # mlx-lm TokenizerWrapper
        self.vocab_size = vocab_size      # the logits' width (may exceed the tokenizer's)
        self.tool_format = tool_format
        self.compiler = Compiler(lambda: self.ll_tokenizer, vocab_size)
        self._ll = None
        self._ll_lock = threading.Lock()  # the preparation and MLX threads both ask

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built from the HF fast tokenizer)."""
        with self._ll_lock:
            if self._ll is None:
                import llguidance.hf

                hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
                try:
                    self._ll = llguidance.hf.from_tokenizer(
                        hf, n_vocab=self.vocab_size,
                        eos_token=sorted(self.tokenizer.eos_token_ids))
                except ValueError as e:  # a slow (Python) tokenizer
                    raise GrammarError(f"constrained decoding is not available for this "
                                       f"model's tokenizer: {e}", "response_format") from None
            return self._ll

    # ---- grammar text -------------------------------------------------------------

    def lit(self, marker: str) -> str:
        """A marker in Lark: its token id when it is one token (special tokens are not
        text to the lexer), else the string."""
        ids = self.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            return f"<[{ids[0]}]>"
        return json.dumps(marker)

    def grammar_for(self, out: OutputSpec, reasoning_first: bool = False,
                    may_think: bool = False) -> Optional[str]:
        """The Lark grammar a request's output must follow, or None (unconstrained).
        `reasoning_first`: the prompt leaves the model inside a think block;
        `may_think`: the model may open one first."""
        body = None
        tools = _allowed(out)
        forced = out.tool_choice == "required" and bool(out.tools)
        auto = bool(tools) and out.tool_choice in (None, "auto") and self._can_force_calls()
        if forced:
            if not tools:
                raise GrammarError("tool_choice names no tool of 'tools'", "tool_choice")
            body = self._calls_rule(tools, out.parallel_tool_calls)
        elif out.response_format is not None:
            schema = {"type": "object"} if out.response_format == "json_object" else out.json_schema
            if not isinstance(schema, dict):
                raise GrammarError("response_format json_schema needs a schema object",
                                   "response_format")
            body = json_rule(closed(schema))
            if auto:
                body = f"{body} | {self._calls_rule(tools, out.parallel_tool_calls)}"
        elif auto:
            body = self._auto_rule(tools, out.parallel_tool_calls)
        if body is None:
            return None
        # Where calls may be made, the marker that opens one (matched on text by the
        # splitter) comes only from the call rule: free text and thinking cannot spell it.
        marker = self.tool_format.start if forced or auto else ""
        start = f"start: {self._thinking(reasoning_first, may_think, marker)} ({body})\n"
        return start + _terminals(start, marker) + json_grammar.definitions(start)

    def _can_force_calls(self) -> bool:
        return self.tool_format is not None and self.tool_format.call_grammar is not None

    def _calls_rule(self, tools: list, parallel: bool, one: str = "") -> str:
        """Lark for the calls of a request (one, or one and more when parallel)."""
        fmt = self.tool_format
        if fmt is None:
            raise GrammarError("this model has no tool-call format, so tool calls cannot be "
                               "required of it", "tool_choice")
        if fmt.call_grammar is None:
            raise GrammarError(f"tool_choice 'required' or a named function is not supported "
                               f"for this model's tool-call format ({fmt.name}); use 'auto'",
                               "tool_choice")
        one = one or self._one_call(tools)
        if not parallel:
            return one
        sep = json.dumps(fmt.separator) if fmt.separator else ""
        return f"({one}) ({sep} ({one}))*"

    def _one_call(self, tools: list) -> str:
        fmt = self.tool_format
        try:
            return fmt.call_grammar(tools, self.lit, fmt.start, fmt.end)
        except ValueError as e:  # a tool this format cannot express (a builder says why)
            raise GrammarError(str(e), "tools") from None

    def _auto_rule(self, tools: list, parallel: bool) -> Optional[str]:
        """tool_choice "auto": free text, and any call the model opens held to the tools'
        schemas in the family's format. None (unconstrained, calls parsed as they come)
        where the format cannot write one of these tools."""
        try:
            one = self._one_call(tools)
        except GrammarError:
            return None
        fmt = self.tool_format
        if not fmt.start:  # Llama 3: an answer that opens with "{" is a call
            return f"{self._calls_rule(tools, parallel, one)} | {_PLAIN}?"
        if not fmt.end:  # Mistral: the calls run to the end of the output
            return f"{_TEXT}? ({self._calls_rule(tools, parallel, one)})?"
        return f"{_TEXT}? ({one} {_TEXT}?){'*' if parallel else '?'}"

    def _thinking(self, reasoning_first: bool, may_think: bool, marker: str = "") -> str:
        tok = self.tokenizer
        if not tok.has_thinking or not (reasoning_first or may_think):
            return ""
        try:  # only single-token markers: then thinking text cannot swallow the end
            start, end = f"<[{tok.think_start_id}]>", f"<[{tok.think_end_id}]>"
        except ValueError:
            return ""
        text = _THINK if marker else "/(.|\\n)*/"
        think = f"{text} {end} /\\n{{0,2}}/"
        return think if reasoning_first else f"({start} {think})?"

    # ---- matchers -----------------------------------------------------------------

    def constraint(self, out: OutputSpec, reasoning_first: bool = False,
                   may_think: bool = False) -> Optional[Constraint]:
        """A fresh Constraint for a request's output, or None. Raises GrammarError (a
        400)."""
        lark = self.grammar_for(out, reasoning_first, may_think)
        if lark is None:
            return None
        param = ("tool_choice" if out.tool_choice == "required" else
                 "response_format" if out.response_format is not None else "tools")
        return self.compile(lark, param)

    def compile(self, lark: str, param: str = "response_format") -> Constraint:
        """A Constraint at the start of `lark` (compiled once, then copied from the cache).
        Raises GrammarError: invalid, over budget, or admitting no output."""
        return Constraint(self.compiler.matcher(lark, param), self.vocab_size, param)


_TEXT, _THINK, _PLAIN = "FREE_TEXT", "THINK_TEXT", "PLAIN_ANSWER"


def _terminals(grammar: str, marker: str) -> str:
    """Lark definitions of the free-text terminals `grammar` uses: text and thinking that
    cannot hold `marker`, and (Llama 3) an answer that does not open with "{"."""
    # The marker as a regex: each character by its code point (no escaping rules to get
    # wrong between Python, Lark and Rust's regex syntax).
    rx = "".join(f"\\x{{{ord(c):x}}}" for c in marker)
    without = f" & ~/(?s:.*){rx}(?s:.*)/" if marker else ""
    defs = {_TEXT: f"/(.|\\n)+/{without}", _THINK: f"/(.|\\n)*/{without}",
            _PLAIN: "/[ \\t\\n]*[^{ \\t\\n](.|\\n)*|[ \\t\\n]+/"}
    return "".join(f"{name}: {value}\n" for name, value in defs.items() if name in grammar)


def closed(schema):
    """`schema` with objects that do not say otherwise closed to unlisted properties
    (additionalProperties: false). Output stays valid against the original schema; it
    only stops a weak model from inventing keys forever."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("enum", "const", "default", "examples"):
            out[k] = v
        elif k in ("properties", "$defs", "definitions", "patternProperties"):
            out[k] = {name: closed(s) for name, s in v.items()} if isinstance(v, dict) else v
        else:
            out[k] = closed(v)
    if "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _allowed(out: OutputSpec) -> list[tuple[str, dict]]:
    """(name, parameters) of the tools a call may use."""
    allowed = []
    for t in out.tools or ():
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        if out.allowed_tools is None or fn["name"] in out.allowed_tools:
            allowed.append((fn["name"], closed(fn.get("parameters") or {})))
    return allowed


__all__ = ["Grammars", "Constraint", "GrammarError"]
