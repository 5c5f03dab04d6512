"""JSON grammars whose numbers stay finite as doubles (issue 30: `"duration_hours": 1e999`
streamed, which every strict parser refuses or reads as infinity).

llguidance's JSON schema compiler writes an unbounded number as
`-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`, which admits `1e999`, and it has no
option to bound it; `minimum`/`maximum` give exponent-free regexes and cannot reach a
double's range. So where a schema can hold an unbounded number (a number or integer
schema without both bounds, or any value: `{}`, `json_object`'s values, an open array or
map), `json_rule` writes the schema out in Lark down to those places, with the finite
number terminals below there, and leaves every part that holds no such number (strings,
enums, bounded numbers...) to llguidance's `%json`. Schemas that use keywords this
translation does not follow (allOf, patternProperties, recursive $refs...) go to
`%json` whole, as before; tool calls are still checked when parsed (tool_formats).
`definitions(grammar)` gives the shared rules a grammar refers to.
"""

from __future__ import annotations

import json

# JSON the grammar lets a model write: compact separators as json.dumps writes them
# (what chat templates render) and no free whitespace, so a weak model cannot pad a
# valid object with blanks forever (DESIGN.md, Constraints).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

NUMBER, INTEGER, ANY = "FINITE_NUMBER", "FINITE_INTEGER", "finite_json_any"
# Below 1e308, so finite: up to 308 integer digits; or one digit, a fraction and an
# exponent up to 307 (1.6e308 at most with 308); a negative exponent only shrinks a value.
# Exponents have three digits at most, so a model cannot write one forever.
_INT = "-?(0|[1-9][0-9]{0,307})"
_DEFS = {
    INTEGER: f"/{_INT}/",
    NUMBER: (f"/{_INT}(\\.[0-9]+)?([eE]-[0-9]{{1,3}})?"
             "|-?[0-9](\\.[0-9]+)?[eE]\\+?([0-9]{1,2}|[0-2][0-9]{2}|30[0-7])"
             "|-?1(\\.[0-6][0-9]*)?[eE]\\+?308/"),
}
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly", "$schema", "$id", "$defs", "definitions"}
_BOUND = 9e15  # added to a half-bounded number (below 2**53: llguidance's range regexes)
_MAX_ITEMS = 64  # array bounds written out as repetitions up to this


class _Unsupported(Exception):
    """A keyword on the way to an unbounded number that the translation does not follow."""


def json_rule(schema) -> str:
    """A Lark expression for JSON that validates against `schema` (server's options),
    every number in it finite as a double where the schema is translatable."""
    try:
        return _expr(schema, _defs_of(schema), ())
    except Exception:  # _Unsupported, or a malformed schema: llguidance's compile says why
        return _llg(schema, {})


def definitions(grammar: str) -> str:
    """Lark definitions of the shared rules `grammar` refers to."""
    out = ""
    if ANY in grammar:
        key = _llg({"type": "string"}, {})
        out = (f'{ANY}: "null" | "true" | "false" | {NUMBER} | {key}'
               f' | "[" ({ANY} (", " {ANY})*)? "]"'
               f' | "{{" ({key} ": " {ANY} (", " {key} ": " {ANY})*)? "}}"\n')
    used = grammar + out
    return out + "".join(f"{name}: {rx}\n" for name, rx in _DEFS.items() if name in used)


def _llg(schema, defs: dict) -> str:
    """llguidance's own %json for `schema` (with the root's definitions, for its $refs)."""
    if isinstance(schema, dict) and defs and "$ref" in json.dumps(schema):
        schema = {**schema, "$defs": defs, "definitions": defs}
    elif not isinstance(schema, dict):
        schema = {} if schema is True else {"not": {}}
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def _defs_of(schema) -> dict:
    if not isinstance(schema, dict):
        return {}
    return {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}


def _expr(schema, defs: dict, refs: tuple) -> str:
    if not _open(schema, defs, refs):
        return _llg(schema, defs)
    if schema is True or schema == {} or (
            isinstance(schema, dict) and set(schema) <= _ANNOTATIONS):
        return ANY
    keys = set(schema) - _ANNOTATIONS
    if "$ref" in schema:
        if keys != {"$ref"}:
            raise _Unsupported
        return _expr(_resolve(schema["$ref"], defs, refs), defs, refs + (schema["$ref"],))
    for word in ("anyOf", "oneOf"):
        if word in schema:
            if keys != {word}:
                raise _Unsupported
            return "(" + " | ".join(_expr(s, defs, refs) for s in schema[word]) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        return "(" + " | ".join(_expr({**schema, "type": t}, defs, refs) for t in kind) + ")"
    if kind in ("number", "integer"):
        return _number(schema, kind, defs)
    if kind == "object":
        return _object(schema, keys, defs, refs)
    if kind == "array":
        return _array(schema, keys, defs, refs)
    raise _Unsupported


def _number(schema: dict, kind: str, defs: dict) -> str:
    low = {"minimum", "exclusiveMinimum"} & set(schema)
    high = {"maximum", "exclusiveMaximum"} & set(schema)
    if not low and not high and "multipleOf" not in schema:
        return INTEGER if kind == "integer" else NUMBER
    # Half-bounded (or a multipleOf): llguidance's range regex, given the missing bound.
    if any(abs(schema[k]) >= _BOUND for k in low | high
           if isinstance(schema[k], (int, float))):
        raise _Unsupported  # the bound given is past what the regex can take with ours
    extra = {}
    if not low:
        extra["minimum"] = -_BOUND
    if not high:
        extra["maximum"] = _BOUND
    return _llg({**schema, **extra}, defs)


def _object(schema: dict, keys: set, defs: dict, refs: tuple) -> str:
    if keys - {"type", "properties", "required", "additionalProperties"}:
        raise _Unsupported
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties", True)
    required = set(schema.get("required") or ())
    if required - set(props) or props and extra is not False:
        raise _Unsupported  # llguidance's order of listed and other keys: left to it
    if not props:
        key = _llg({"type": "string"}, {})
        value = _expr(extra, defs, refs)
        return f'"{{" ({key} ": " {value} (", " {key} ": " {value})*)? "}}"'
    items = [(f"{json.dumps(json.dumps(k, ensure_ascii=False) + ': ')} {_expr(s, defs, refs)}",
              k in required) for k, s in props.items()]
    return f'"{{" {ordered_args(items, json.dumps(", "))} "}}"'


def _array(schema: dict, keys: set, defs: dict, refs: tuple) -> str:
    if keys - {"type", "items", "minItems", "maxItems"}:
        raise _Unsupported
    item = _expr(schema.get("items", True), defs, refs)
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if max(low, high or 0) > _MAX_ITEMS:
        raise _Unsupported
    if high == 0:
        return '"[" "]"'
    reps = max(low - 1, 0)
    if high is None:
        reps = "*" if reps == 0 else f"{{{reps},}}"
    else:
        reps = f"{{{reps},{high - 1}}}"
    body = f'{item} (", " {item}){reps}'
    return f'"[" {body} "]"' if low else f'"[" ({body})? "]"'


def ordered_args(items: list[tuple[str, bool]], sep: str = "") -> str:
    """Lark for an ordered subsequence of `items` (expressions, required?) holding every
    required one, joined by `sep` (a Lark literal, or "" for none). Built right to left:
    `rest` is the tail once something was written (each item then needs `sep` first),
    `first` the tail before anything was."""
    rest = first = ""
    for expr, required in reversed(items):
        joined = f"{sep} {expr}" if sep else expr
        if required:
            first = f"{expr} {rest}"
            rest = f"{joined} {rest}"
        else:
            first = f"({expr} {rest} | {first})" if first.strip() else f"({expr} {rest})?"
            rest = f"({joined})? {rest}"
    return first.strip()


def _resolve(ref: str, defs: dict, refs: tuple):
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix) and ref[len(prefix):] in defs and ref not in refs:
            return defs[ref[len(prefix):]]
    raise _Unsupported  # the root, another document, or recursion: left to llguidance


def _open(schema, defs: dict, refs: tuple) -> bool:
    """Whether `schema` can hold a number without both bounds (or any value)."""
    if schema is True or schema == {}:
        return True
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return False
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref in refs:
            return False  # already being looked at, further up
        try:
            target = _resolve(ref, defs, refs)
        except _Unsupported:
            return True
        return _open(target, defs, refs + (ref,))
    for word in ("anyOf", "oneOf", "allOf"):
        if any(_open(s, defs, refs) for s in schema.get(word) or ()):
            return True
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if None in kinds and not {"anyOf", "oneOf", "allOf", "enum", "const"} & set(schema):
        return True  # no type: any value the other keywords allow
    if kinds & {"number", "integer"}:
        low = {"minimum", "exclusiveMinimum"} & set(schema)
        high = {"maximum", "exclusiveMaximum"} & set(schema)
        if not (low and high):
            return True
    if "object" in kinds:
        extra = schema.get("additionalProperties", True)
        if extra is not False and _open(extra, defs, refs):
            return True
        subs = list((schema.get("properties") or {}).values())
        subs += list((schema.get("patternProperties") or {}).values())
        if any(_open(s, defs, refs) for s in subs):
            return True
    if "array" in kinds:
        if _open(schema.get("items", True), defs, refs):
            return True
        if any(_open(s, defs, refs) for s in schema.get("prefixItems") or ()):
            return True
    return False
