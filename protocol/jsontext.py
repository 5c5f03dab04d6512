"""Strict JSON text: what every strict parser (Go's encoding/json, JavaScript's JSON.parse)
reads back as the same finite values.

Python's json module reads and writes NaN, Infinity and -Infinity, and reads a number
beyond a double (`1e999`) as inf, which it then writes as `Infinity`: text a strict
client refuses. Tool-call arguments are checked here before they leave the worker
(worker/text/tool_formats.py), and the supervisor reads them back with the same rules where an
API wants them as an object (Anthropic's `input`). Imports nothing else of the server.
"""

from __future__ import annotations

import json
import math


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} does not fit a double")
    return value


def _finite_int(text: str) -> int:
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"the number {text[:40]}… does not fit a double") from None
    return value


DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float,
                           parse_int=_finite_int)


def loads(text: str):
    """The value of strict JSON `text`; ValueError for anything else (NaN, Infinity,
    numbers beyond a double, trailing text)."""
    value, end = DECODER.raw_decode(text, _skip(text, 0))
    if _skip(text, end) != len(text):
        raise ValueError("extra text after the JSON value")
    return value


def dumps(value) -> str:
    """Compact JSON text of `value`; ValueError if it holds a non-finite number."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    loads(text)  # an int beyond a double is written exactly: still not finite to a client
    return text


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos
