"""Test shorthand for protocol Generates: flat keyword arguments, sorted into the nested
structs by field name (production code builds the structs itself: each surface's request.py).

    generate(prompt="x", max_tokens=3, stop=["a"])
    == Generate(rid="", prompt="x", sampling=SamplingParams(max_tokens=3),
                output=OutputSpec(stop=("a",)))
    generate(prompt="x", namespace="k", resume_from="resp_1")
    == Generate(rid="", prompt="x", cache=PromptCache(namespace="k", resume_from="resp_1"))

msgspec.convert checks each value against the protocol's types (and makes lists the
tuples the structs hold), so a test cannot build a request the codec would refuse.
"""

from __future__ import annotations

import msgspec

from protocol import Generate, OutputSpec, PromptCache, SamplingParams

_SAMPLING = frozenset(SamplingParams.__struct_fields__)
_OUTPUT = frozenset(OutputSpec.__struct_fields__)
_CACHE = frozenset(PromptCache.__struct_fields__)


def generate(rid: str = "", **fields) -> Generate:
    sampling = {k: fields.pop(k) for k in list(fields) if k in _SAMPLING}
    output = {k: fields.pop(k) for k in list(fields) if k in _OUTPUT}
    cache = {k: fields.pop(k) for k in list(fields) if k in _CACHE}
    return Generate(rid=rid, sampling=msgspec.convert(sampling, SamplingParams),
                    output=msgspec.convert(output, OutputSpec),
                    cache=msgspec.convert(cache, PromptCache), **fields)
