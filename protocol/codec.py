"""The one msgpack codec of the protocol: msgspec, one decoder per direction.

Wire form: a msgpack map {"type": kind, "v": version, **fields} (protocol/messages.py).
Decoding validates the frame against the direction's tagged union of message types — the
kind, that required fields are present, every field's declared type (nested structs,
enums and literals included) — then checks the version. Unknown fields are ignored (a
newer peer may add fields at the end). Anything else raises ProtocolError: decoding never
crashes on garbage. (A map without "v" reads as this version, as a missing field takes its
default: every peer since version 1 writes it, so only a frame of no mlxd peer lacks it.)

Encoding is guarded the same way: a value msgpack cannot carry (a string with a lone UTF-16
surrogate, an integer outside 64 bits, an object of no msgpack type, nesting past the
recursion limit) raises `EncodeError` naming the field, never a bare OverflowError or
UnicodeEncodeError from inside msgpack. The supervisor fails that one request with it; a
field added later cannot reopen the hole. Which field it was is found the slow way, and
only on failure.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from protocol.messages import DOWN, PROTOCOL_VERSION, UP, Message


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class EncodeError(ProtocolError):
    """A message holding a value that cannot travel. `field` names the message's field
    (the innermost one for a nested struct: "max_tokens" of Generate.sampling); the text
    gives the whole path ("generate.sampling.max_tokens")."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# What msgspec raises for a value it cannot encode (RecursionError: nested too deep).
_UNENCODABLE = (OverflowError, UnicodeEncodeError, TypeError, ValueError, RecursionError)

_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_down = msgspec.msgpack.Decoder(Union[DOWN])  # type: ignore[valid-type]
_up = msgspec.msgpack.Decoder(Union[UP])  # type: ignore[valid-type]
_MESSAGES = frozenset(DOWN + UP)


def encode(msg: Message) -> bytes:
    if type(msg) not in _MESSAGES:
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    try:
        return _encode(msg)
    except _UNENCODABLE as e:
        raise _encode_error(msg, msg.kind, e) from None


def _encode_error(struct: msgspec.Struct, path: str, e: Exception) -> EncodeError:
    """The slow path, on failure only: the (innermost) field that cannot travel."""
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        try:
            _encode(value)
        except _UNENCODABLE as fe:
            if isinstance(value, msgspec.Struct):
                return _encode_error(value, f"{path}.{name}", fe)
            return EncodeError(f"{path}.{name} cannot be encoded: {_why(fe)}", name)
    return EncodeError(f"{path} cannot be encoded: {_why(e)}")


def _why(e: Exception) -> str:
    if isinstance(e, UnicodeEncodeError):
        return "a string is not valid Unicode (a lone surrogate)"
    if isinstance(e, OverflowError):
        return "an integer does not fit in 64 bits"
    if isinstance(e, RecursionError):
        return "values are nested too deeply"
    return str(e)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    try:
        msg = decoder.decode(data)
    except (msgspec.MsgspecError, RecursionError) as e:
        # DecodeError: not msgpack; ValidationError: not a message of this direction.
        raise ProtocolError(f"invalid frame: {e}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.v!r}, expected {PROTOCOL_VERSION}")
    return msg


class _Addressed(msgspec.Struct):
    """What a frame that is no valid message may still tell: its kind and its rid."""
    type: Any = None
    rid: Any = None


_addressed = msgspec.msgpack.Decoder(_Addressed)


def unreadable_generate_rid(data: bytes) -> str | None:
    """For a frame decode_down refused: the rid, if it is a Generate whose kind and rid can
    still be read (so the worker can answer it rather than leave it waiting); else None."""
    try:
        head = _addressed.decode(data)
    except (msgspec.MsgspecError, RecursionError):
        return None
    if head.type == "generate" and isinstance(head.rid, str) and head.rid:
        return head.rid
    return None


def decode_down(data: bytes):
    """Decode a supervisor → worker frame (what the worker reads)."""
    return _decode(_down, data)


def decode_up(data: bytes):
    """Decode a worker → supervisor frame (what the supervisor reads)."""
    return _decode(_up, data)
