"""Hostile values and the mutations that put them into valid requests.

A mutation takes a valid body, picks any place in it (any value at any depth, or a new
key of any object, named after a real parameter so it reaches real code) and puts a
hostile value there. Some values are not expressible as Python JSON: `Raw` holds their
exact text (NaN and Infinity literals, 1e999, nesting deeper than json.dumps recurses,
a lone surrogate escape), spliced into the serialized body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class Raw:
    """A value written into the body as this exact JSON text."""
    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'…' if len(self.text) > 40 else ''})"


def nested(depth: int, open_: str = "[", close: str = "]", inner: str = "1") -> Raw:
    return Raw(open_ * depth + inner + close * depth)


SURROGATES = ["\ud800", "a\udfffb", "\udbff\udbff", "ok \ud83d", "\ud83d\ude00\ud800"]
INTEGERS = [2 ** 64, -(2 ** 64), 2 ** 63, -(2 ** 63) - 1, 2 ** 63 - 1, -(2 ** 63), 10 ** 30,
            -1, 0, 1, 2 ** 31, 2 ** 32 + 1]
FLOATS = [1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, 3.4e38]
LITERALS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"),
            Raw('"\\ud800"'), Raw('"\\udc00x"'), Raw("1" * 400), Raw("-" + "9" * 400)]
DEEP = [nested(600), nested(3000), nested(600, "{\"a\":", "}"), nested(200, "[", "]", '"x"')]
WRONG_TYPES = [True, False, None, "", "null", "0", [], {}, [None], {"": None}, [[]], {"a": {}}]
HUGE = [lambda: "x" * 300_000, lambda: "é" * 100_000, lambda: list(range(20_000)),
        lambda: ["s"] * 5_000, lambda: {f"k{i}": i for i in range(5_000)},
        lambda: [{"role": "user", "content": "hi"}] * 2_000, lambda: "\u0000" * 1000,
        lambda: "😀" * 50_000, lambda: "<|im_start|>" * 2_000]


def hostile_values() -> st.SearchStrategy:
    """Every kind of value the issue names, plus hypothesis' own fuzzing of each type."""
    return st.one_of(
        st.sampled_from(SURROGATES),
        st.sampled_from(INTEGERS),
        st.sampled_from(FLOATS),
        st.sampled_from(LITERALS),
        st.sampled_from(DEEP),
        st.sampled_from(WRONG_TYPES),
        st.sampled_from(HUGE).map(lambda make: make()),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        # Any code point, surrogates included (st.text leaves them out by default).
        st.text(st.characters(codec=None, categories=None), max_size=40),
        st.lists(st.integers(), max_size=8),
        st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4),
    )


def places(body, path=()) -> list[tuple]:
    """Every place in `body` a value can go: ("set", path) for each existing value and
    ("add", path) for each object (a new key there)."""
    out = []
    if isinstance(body, dict):
        out.append(("add", path))
        for k, v in body.items():
            out.append(("set", path + (k,)))
            out += places(v, path + (k,))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out.append(("set", path + (i,)))
            out += places(v, path + (i,))
    return out


def mutate(body, place: tuple, key: str, value):
    """A deep copy of `body` with `value` at `place` (for "add": under `key`)."""
    body = json.loads(json.dumps(body))
    action, path = place
    if action == "set" and not path:
        return value
    target = body
    steps = path if action == "add" else path[:-1]
    for step in steps:
        target = target[step]
    target[key if action == "add" else path[-1]] = value
    return body


def serialize(body) -> str:
    """JSON text of `body`, with every Raw spliced in as its exact text."""
    raws: list[str] = []

    def default(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\u0000RAW{len(raws) - 1}\u0000"
        raise TypeError(type(o).__name__)

    text = json.dumps(body, default=default, allow_nan=True)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0000RAW{i}\u0000"), raw, 1)
    return text
