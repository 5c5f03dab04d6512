"""The one msgpack codec of the protocol.

Wire form: a msgpack map {"v": version, "type": kind, **fields}. Decoding checks the
version, the type, that required fields are present and that every known field has the
declared type; unknown fields are ignored (a newer peer may add fields at the end).
Anything else raises ProtocolError: decoding never crashes on garbage.

Encoding is guarded the same way: a value msgpack cannot carry (a string with a lone UTF-16
surrogate, an integer outside 64 bits, an object of no msgpack type) raises `EncodeError`
naming the field, never a bare OverflowError or UnicodeEncodeError from inside msgpack. The
supervisor fails that one request with it; a field added later cannot reopen the hole.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack

from protocol.messages import DOWN, PROTOCOL_VERSION, UP


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class EncodeError(ProtocolError):
    """A message holding a value that cannot travel; `field` names the message field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _allowed(tp) -> tuple[tuple[type, ...], bool]:
    """(isinstance types, nullable) for an annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        allowed: tuple[type, ...] = ()
        for a in args:
            if a is not type(None):
                allowed += _allowed(a)[0]
        return allowed, nullable
    if tp is float:
        return (float, int), False
    if tp is int:
        return (int,), False
    return ((origin or tp),), False


class _Spec:
    __slots__ = ("cls", "names", "required", "checks")

    def __init__(self, cls):
        hints = typing.get_type_hints(cls)
        self.cls = cls
        fields = dataclasses.fields(cls)
        self.names = tuple(f.name for f in fields)
        self.required = tuple(
            f.name for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.checks = {f.name: _allowed(hints[f.name]) for f in fields}


def _registry(classes) -> dict[str, _Spec]:
    return {c.kind: _Spec(c) for c in classes}


_DOWN = _registry(DOWN)
_UP = _registry(UP)
_SPECS = {**{s.cls: s for s in _DOWN.values()}, **{s.cls: s for s in _UP.values()}}


def encode(msg) -> bytes:
    spec = _SPECS.get(type(msg))
    if spec is None:
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    d: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.kind}
    for name in spec.names:
        d[name] = getattr(msg, name)
    try:
        return msgpack.packb(d, use_bin_type=True)
    except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as e:
        # The slow path runs only on failure: find the field that cannot travel.
        for name in spec.names:
            try:
                msgpack.packb(d[name], use_bin_type=True)
            except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as fe:
                raise EncodeError(f"{msg.kind}.{name} cannot be encoded: {_why(fe)}",
                                  name) from None
        raise EncodeError(f"{msg.kind} cannot be encoded: {_why(e)}") from None


def _why(e: Exception) -> str:
    if isinstance(e, UnicodeEncodeError):
        return "a string is not valid Unicode (a lone surrogate)"
    if isinstance(e, OverflowError):
        return "an integer does not fit in 64 bits"
    return str(e)


def _decode(data: bytes, registry: dict[str, _Spec]):
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError("frame is not a map")
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r}, expected {PROTOCOL_VERSION}")
    spec = registry.get(d.get("type"))  # type: ignore[arg-type]
    if spec is None:
        raise ProtocolError(f"unknown message type {d.get('type')!r}")
    kwargs = {}
    for name in spec.names:
        if name not in d:
            continue
        value = d[name]
        allowed, nullable = spec.checks[name]
        if value is None:
            if not nullable:
                raise ProtocolError(f"{spec.cls.kind}.{name} may not be null")
        elif not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ProtocolError(f"{spec.cls.kind}.{name} has type {type(value).__name__}")
        kwargs[name] = value
    missing = [n for n in spec.required if n not in kwargs]
    if missing:
        raise ProtocolError(f"{spec.cls.kind} lacks {', '.join(missing)}")
    return spec.cls(**kwargs)


def decode_down(data: bytes):
    """Decode a supervisor → worker frame (what the worker reads)."""
    return _decode(data, _DOWN)


def decode_up(data: bytes):
    """Decode a worker → supervisor frame (what the supervisor reads)."""
    return _decode(data, _UP)
