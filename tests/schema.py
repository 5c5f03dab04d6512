"""Validate JSON against a component of OpenAI's spec, vendored in tests/openapi/.

    validate(instance, "CreateChatCompletionResponse")           # raises ValidationError
    validate(chunk, "CreateChatCompletionStreamResponse", strict=True)

The spec says `openapi: 3.1.0` (JSON Schema 2020-12) but still carries OpenAPI 3.0
constructs that a 2020-12 validator would misread, so they are translated on load:
- `nullable: true` (111 places; 3.0) is not a 2020-12 keyword and would be ignored, making
  every such null a wrong rejection. It becomes `anyOf: [<schema>, {type: "null"}]` (the
  wrapper, not `type: [.., "null"]`, because 24 of them have no `type` and 4 sit beside a
  `$ref`).
- `exclusiveMinimum: true` beside `minimum: x` (3.0's boolean form) becomes
  `exclusiveMinimum: x`; in 2020-12 a boolean there would be compared as the number 1.
- YAML timestamps are left as strings (an example holds a bare date).
`discriminator` needs no translation (oneOf already decides), and `format` is not asserted.

strict=True also rejects properties the spec does not define (`unevaluatedProperties:
false` on object schemas, skipping those used as allOf parts, which would otherwise reject
their siblings' properties). Meant for response shapes: it catches a misspelt optional key.

The YAML (3 MB) is parsed once per test process and the translation cached.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, ValidationError
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parent / "openapi" / "openapi.yaml"
_BASE_URI = "urn:mlxd:openai-openapi"
_REF_PREFIX = "#/components/schemas/"
# Keys whose values are data, not schemas: never translate inside them.
_DATA_KEYS = frozenset({"example", "examples", "default", "enum", "const"})

_YamlBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_YamlBase):  # type: ignore[misc, valid-type]
    """Safe (C) loader that keeps timestamps as strings, as JSON would."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _YamlBase.yaml_implicit_resolvers.items()
}


@functools.cache
def spec() -> dict:
    """The raw spec document (do not mutate)."""
    with open(SPEC_PATH, "rb") as f:
        return yaml.load(f, Loader=_Loader)


def component_names() -> list[str]:
    return sorted(spec()["components"]["schemas"])


def _allof_parts(node, found: set) -> set:
    """Names of components referenced directly as an allOf part anywhere."""
    if isinstance(node, dict):
        for part in node.get("allOf", ()) if isinstance(node.get("allOf"), list) else ():
            ref = part.get("$ref", "") if isinstance(part, dict) else ""
            if ref.startswith(_REF_PREFIX):
                found.add(ref[len(_REF_PREFIX):])
        for key, value in node.items():
            if key not in _DATA_KEYS:
                _allof_parts(value, found)
    elif isinstance(node, list):
        for item in node:
            _allof_parts(item, found)
    return found


def _translate(node, strict: bool, allof_part: bool = False):
    """A 2020-12 copy of an OpenAPI schema node (see the module docstring)."""
    if isinstance(node, list):
        return [_translate(item, strict) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYS or key.startswith("x-"):
            out[key] = value
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_translate(item, strict, allof_part=True) for item in value]
        else:
            out[key] = _translate(value, strict)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), bool):
            if out.pop(bound) and limit in out:
                out[bound] = out.pop(limit)
    if strict and not allof_part and ("properties" in out or "allOf" in out) \
            and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["unevaluatedProperties"] = False
    nullable = out.pop("nullable", None)
    if nullable is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _registry(strict: bool) -> Registry:
    schemas = spec()["components"]["schemas"]
    parts = _allof_parts(schemas, set())
    translated = {name: _translate(schema, strict, allof_part=name in parts)
                  for name, schema in schemas.items()}
    doc = {"components": {"schemas": translated}}
    return Registry().with_resource(_BASE_URI, Resource(doc, DRAFT202012))


@functools.cache
def validator(name: str, strict: bool = False) -> Draft202012Validator:
    if name not in spec()["components"]["schemas"]:
        raise KeyError(f"no component schema {name!r} in {SPEC_PATH.name}")
    return Draft202012Validator({"$ref": f"{_BASE_URI}{_REF_PREFIX}{name}"},
                                registry=_registry(strict))


def errors(instance, name: str, strict: bool = False) -> list[ValidationError]:
    return list(validator(name, strict).iter_errors(instance))


def validate(instance, name: str, strict: bool = False) -> None:
    """Raise the most relevant ValidationError if `instance` is not a valid `name`."""
    error = best_match(validator(name, strict).iter_errors(instance))
    if error is not None:
        raise error
