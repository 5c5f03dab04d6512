"""Tool-call formats of model families: how a call is marked, parsed, and constrained.

Parsing uses mlx-lm's own parsers (mlx_lm/tool_parsers/*), picked the way mlx-lm picks
them: the tokenizer config's `tool_parser_type`, else inferred from the chat template
(`tokenizer_utils._infer_tool_parser`, which `mlx_lm.load` already ran; it records the
name in the tokenizer's init_kwargs). mlx-lm has no parser for Llama 3's JSON calls
(`{"name": ..., "parameters": {...}}`, no markers), so that one lives here.

Grammars (for tool_choice "required" or a named function, and for a call the model opens
under "auto") write the call exactly the way the family's template renders one, so the
same parser reads it back; its JSON values come from worker/text/json_grammar.py. Each builder
returns Lark (llguidance's dialect) for ONE call to any of the given tools; the caller
(worker/text/constraints.py) repeats it for parallel calls. Families without a builder here
(Gemma 4's, Kimi's, GLM's, MiniMax's argument syntaxes) still parse; forcing calls on
them is refused with a clear error.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Callable, Optional

from protocol import jsontext
from worker.text.json_grammar import json_rule, ordered_args

log = logging.getLogger("worker.tools")

# (tool name, its parameters schema)
ToolSpec = tuple[str, dict]
# lit(marker) -> a Lark expression for a marker (a token id when it is one token)
Literal = Callable[[str], str]


def _object_schema(params) -> dict:
    """A tool's parameters schema; absent means no arguments: `{}` (closed, like every
    object the grammar writes; see constraints.closed)."""
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return params


def _call_object(name: str, params: dict, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, key: _object_schema(params)},
            "required": ["name", key], "additionalProperties": False}


# ---- grammar builders: one call of any of `tools` ------------------------------------

def _json_call(key: str):
    def build(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
        body = {"anyOf": [_call_object(n, p, key) for n, p in tools]}
        if not start:  # Llama 3: the call is the JSON object alone
            return json_rule(body)
        return f'{lit(start)} "\\n" {json_rule(body)} "\\n" {lit(end)}'
    return build


def _mistral_call(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
    # Current templates ([ARGS]): [TOOL_CALLS]name[ARGS]{...}; one marker per call.
    alts = " | ".join(f'{json.dumps(n)} {lit("[ARGS]")} {json_rule(_object_schema(p))}'
                      for n, p in tools)
    return f"{lit(start)} ({alts})"


def _mistral_list_call(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
    # Older templates: [TOOL_CALLS] [{"name": ..., "arguments": {...}}]
    body = {"type": "array", "items": {"anyOf": [_call_object(n, p, "arguments")
                                                 for n, p in tools]},
            "minItems": 1, "maxItems": 1}
    return f'{lit(start)} " " {json_rule(body)}'


def _properties(params: dict) -> list[tuple[str, dict, bool]]:
    params = _object_schema(params)
    required = set(params.get("required") or ())
    return [(k, v if isinstance(v, dict) else {}, k in required)
            for k, v in (params.get("properties") or {}).items()]


def _pythonic_call(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
    # [name(a=1, b="x")]: JSON values are Python literals to the parser (it maps
    # true/false/null), so each value is the JSON its schema allows.
    alts = []
    for name, params in tools:
        args = [(f'"{k}=" {json_rule(s)}', req) for k, s, req in _properties(params)]
        alts.append(f'"{name}(" {ordered_args(args, json.dumps(", "))} ")"')
    return f'{lit(start)} "[" ({" | ".join(alts)}) "]" {lit(end)}'


def _xml_value(schema: dict) -> str:
    """A Qwen3-coder parameter value: raw text for strings (the parser keeps it as is),
    JSON for the rest (the parser converts by the schema's type)."""
    kind = schema.get("type")
    if kind == "string" and "enum" in schema:
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return f"/[^<\\n]{{{lo},{'' if hi is None else hi}}}/"
    return json_rule(schema)


def _qwen3_coder_call(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
    alts = []
    for name, params in tools:
        args = [(f'"<parameter={k}>\\n" {_xml_value(s)} "\\n</parameter>\\n"', req)
                for k, s, req in _properties(params)]
        alts.append(f'"<function={name}>\\n" {ordered_args(args)} "</function>"')
    return f'{lit(start)} "\\n" ({" | ".join(alts)}) "\\n" {lit(end)}'


def _gemma_value(name: str, key: str, schema: dict, esc: str) -> str:
    """A FunctionGemma argument value. mlx-lm's parser reads `call:NAME{...}` up to the
    first `}`, strings between <escape> markers, anything else up to the next `,` as JSON:
    so strings may hold neither `<` nor `}`, and other values must be JSON scalars."""
    kind = schema.get("type")
    enum = schema.get("enum")
    if kind == "string" or (kind is None and enum and all(isinstance(v, str) for v in enum)):
        if enum:
            return f'{esc} ({" | ".join(json.dumps(v) for v in enum)}) {esc}'
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return f"{esc} /[^<}}]{{{lo},{'' if hi is None else hi}}}/ {esc}"
    if kind in ("integer", "number", "boolean", "null"):
        return json_rule(schema)
    raise ValueError(f"the argument '{key}' of '{name}' is a {kind or 'schema'} value, which "
                     "this model's call format (FunctionGemma) cannot carry; use 'auto'")


def _gemma_call(tools: list[ToolSpec], lit: Literal, start: str, end: str) -> str:
    # FunctionGemma: <start_function_call>call:name{k:<escape>text<escape>,n:3}<end_function_call>
    esc = lit("<escape>")
    alts = []
    for name, params in tools:
        args = [(f'"{k}:" {_gemma_value(name, k, s, esc)}', req) for k, s, req in _properties(params)]
        alts.append(f'"call:{name}{{" {ordered_args(args, json.dumps(","))} "}}"')
    return f'{lit(start)} ({" | ".join(alts)}) {lit(end)}'


# ---- formats -------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolFormat:
    name: str                         # mlx-lm's parser name, or "llama3_json"
    start: str                        # marker opening a call ("" for Llama 3's JSON)
    end: str                          # marker closing it ("" when none, as Mistral)
    parse: Callable                   # (text, tools) -> dict | list[dict], raises on junk
    call_grammar: Optional[Callable] = None  # (tools, lit, start, end) -> Lark of one call
    separator: str = "\n"             # between parallel calls in the grammar


def _parse_llama3_json(text: str, tools=None):
    """Llama 3.x JSON calls: one object, or several separated by ';'."""
    calls = []
    for part in text.split(";") if text.strip().startswith("{") else [text]:
        obj = json.loads(part.strip())
        args = obj.get("parameters", obj.get("arguments"))
        if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            raise ValueError("not a Llama 3 JSON tool call")
        calls.append({"name": obj["name"], "arguments": args})
    return calls[0] if len(calls) == 1 else calls


_BUILDERS = {
    "json_tools": _json_call("arguments"),
    "pythonic": _pythonic_call,
    "qwen3_coder": _qwen3_coder_call,
    "function_gemma": _gemma_call,
}

LLAMA3_JSON = ToolFormat("llama3_json", "", "", _parse_llama3_json,
                         _json_call("parameters"), "; ")


def mlx_lm_format(name: str, template: str = "") -> ToolFormat:
    """The ToolFormat of mlx-lm's parser module `name`."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    builder = _BUILDERS.get(name)
    separator = "\n"
    if name == "mistral":
        builder = _mistral_call if "[ARGS]" in template else _mistral_list_call
        separator = ""
    return ToolFormat(name, module.tool_call_start, module.tool_call_end or "",
                      module.parse_tool_call, builder, separator)


def detect(tokenizer) -> Optional[ToolFormat]:
    """The tool-call format of a loaded mlx-lm tokenizer, or None."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    name = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if name is None and tokenizer.tool_parser is not None:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
        name = _infer_tool_parser(tokenizer)
    if name:
        try:
            return mlx_lm_format(name, template)
        except (ImportError, AttributeError):
            log.warning("unknown tool parser %r; tool calls will not be parsed", name)
            return None
    # Llama 3.1+ templates ask for {"name": ..., "parameters": ...} with no markers.
    if '"parameters": dictionary of argument name' in template:
        return LLAMA3_JSON
    return None


def normalize_calls(parsed, text: str = "") -> list[dict]:
    """A parser's result (one dict or a list) for the call text `text`, as a list of
    {"name", "arguments" (JSON text), "id"?}. Raises ValueError for junk, and for arguments
    a strict JSON parser would refuse (NaN, or a number beyond a double)."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    out, pos = [], 0
    for c in calls:
        if not (isinstance(c, dict) and isinstance(c.get("name"), str)):
            raise ValueError("a tool call without a name")
        args = c.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError("tool call arguments are not an object")
        args_text, pos = arguments_text(args, text, pos)
        out.append({"name": c["name"], "arguments": args_text, "id": c.get("id")})
    return out


def arguments_text(args: dict, text: str, pos: int = 0) -> tuple[str, int]:
    """(the arguments as JSON text, where to look for the next call's). Where the model
    wrote them as a strict JSON object (JSON formats: json_tools, Mistral, Llama 3, Kimi),
    that text exactly, found in `text` from `pos` on as the first object holding the
    parsed value; else (key=value, XML or Python-like formats) compact JSON. Either is
    strict JSON: ValueError where it cannot be (a number beyond a double)."""
    want = _same_value(args)
    start = text.find("{", pos)
    while start >= 0:
        try:
            value, end = jsontext.DECODER.raw_decode(text, start)
        except ValueError:
            value = end = None
        if isinstance(value, dict) and _same_value(value) == want:
            return text[start:end], end
        start = text.find("{", start + 1)
    return jsontext.dumps(args), pos


def _same_value(value) -> str:
    """A key for comparing parsed JSON values exactly (1, 1.0 and true differ)."""
    return json.dumps(value, sort_keys=True)


# A call cut off mid-way (max_tokens): what can be read of it. JSON formats write the
# name first ("name": "f", then "arguments"/"parameters": {...); the others open with
# the name (<function=f>, call:f{, f( , f[ARGS]).
_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"|<function=([^>\s]+)>'
                       r'|call:([\w.-]+)|^\W*([A-Za-z_][\w.-]*)(?=\(|\[ARGS\])')
_CUT_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*|\[ARGS\]')


def cut_call(text: str) -> tuple[str, str]:
    """(name, arguments so far) of a call the output ended inside: the name where it was
    written whole ("" before that), and the arguments' text as far as it got where the
    format writes them as JSON (else ""). Never raises: the text is unfinished."""
    m = _CUT_NAME.search(text)
    name = ""
    if m is not None:
        raw = next(g for g in m.groups() if g is not None)
        try:
            name = json.loads(f'"{raw}"') if m.group(1) is not None else raw
        except ValueError:
            name = raw
    a = _CUT_ARGS.search(text, m.end() if m is not None else 0)
    return name, (text[a.end():].rstrip() if a is not None else "")
