"""Values a request body may hold: what JSON allows but nothing downstream can carry.

JSON (and Python's json module) accepts three things that break the layers below:
- strings holding a lone UTF-16 surrogate (`"\\ud800"`): not Unicode, so they cannot be
  encoded as UTF-8 for msgpack, a tokenizer or SQLite;
- integers of any size (`1e2` is a float, but `18446744073709551616` is an int): msgpack
  carries 64 bits at most, and no parameter means anything beyond that;
- numbers too large for a double (`1e999` parses as infinity): not JSON when written back;
- nesting deeper than MAX_DEPTH: every layer below walks it recursively (chat templates,
  JSON-schema rewriting, grammar compilation, msgpack), and no request means it.

`first_bad_value` walks the whole parsed body once (iteratively: nesting depth is bounded
by the JSON parser, not by this walk) and names the first offender by its path, so the
client gets a 400 naming the parameter (`messages[0].content`) instead of a model wedged by
a message that failed to encode. It is pure: no aiohttp, no errors of its own.
"""

from __future__ import annotations

import math
from typing import Any, Optional

INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_DEPTH = 64  # objects and arrays inside each other; real tool schemas nest ~10 deep


def first_bad_value(body: Any) -> Optional[tuple[str, str]]:
    """(path, why) of the first value in `body` that cannot travel, or None."""
    stack: list[tuple[str, Any, int]] = [("", body, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_DEPTH and isinstance(value, (dict, list)):
            return path, (f"nesting too deep: objects and arrays may nest at most "
                          f"{MAX_DEPTH} levels.")
        if isinstance(value, str):
            why = _bad_string(value)
            if why:
                return path, why
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                return path, (f"integer out of range. Expected a 64-bit integer "
                              f"(between {INT_MIN} and {INT_MAX}), but got "
                              f"{_short_int(value)} instead.")
        elif isinstance(value, float):
            if not math.isfinite(value):
                return path, "number out of range. Expected a finite number."
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                key_path = f"{path}.{key}" if path else key
                why = _bad_string(key)
                if why:
                    return (path or "body"), f"an object key is not valid: {why}"
                items.append((key_path, item, depth + 1))
            stack.extend(reversed(items))  # report the first offender in document order
        elif isinstance(value, list):
            if _plain_ints(value):
                continue  # token ids: nothing in them to walk one by one
            stack.extend((f"{path}[{i}]", item, depth + 1)
                         for i, item in reversed(list(enumerate(value))))
    return None


def _plain_ints(values: list) -> bool:
    """A non-empty list of ints (no bools), all within 64 bits: checked in C, in one pass
    over the types and one over the values, where a prompt of token ids may hold tens of
    thousands."""
    return (bool(values) and not set(map(type, values)) - {int}
            and INT_MIN <= min(values) and max(values) <= INT_MAX)


def _bad_string(s: str) -> Optional[str]:
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the string is not valid Unicode: it holds a lone UTF-16 surrogate "
                f"(\\u{ord(s[e.start]):04x}) at position {e.start}.")
    return None


def _short_int(value: int) -> str:
    digits = len(str(abs(value)))  # at most ~4300 digits: Python's own parse limit
    return str(value) if digits <= 30 else f"an integer of {digits} digits"
