"""The protocol's enums and packed arrays: what a message's fields say in words (why a
request ended, what it computes, what a model does, what an error is about) and how token
ids and log-probabilities travel (little-endian arrays, not msgpack lists of numbers).
protocol/messages.py builds its structs from them and re-exports them, so both sides
import them from there as they always have.
"""

from __future__ import annotations

import sys
from array import array
from enum import Enum


class WireEnum(str, Enum):
    """A string-valued enum: what travels (and what str() and f-strings give) is the
    value, so a member compares, hashes and renders as its string."""

    def __str__(self) -> str:
        return str.__str__(self)


class FinishReason(WireEnum):
    """Why a Generate ended (Done.finish_reason)."""
    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"
    ERROR = "error"


class Task(WireEnum):
    """What a Generate computes, and the message that carries its result."""
    GENERATE = "generate"      # tokens: Started, Delta..., Done
    TOKENIZE = "tokenize"      # the prompt's ids as a generation would see them (chat
    #                            template and tools applied), no prefill: Started, Tokens, Done
    DETOKENIZE = "detokenize"  # `prompt_ids` → text: Started, Tokens (text), Done
    EMBED = "embed"            # one vector per item of `inputs`: Started, Pooled, Done
    SCORE = "score"            # rerank: each of `inputs` (documents) against `prompt` (the
    #                            query), one relevance score each: Started, Pooled (dim 1), Done
    TRANSCRIBE = "transcribe"  # `audio` (a file) to text: Started, Delta (the text of each
    #                            stretch decoded, as it is)..., Transcript, Done
    SPEAK = "speak"            # `prompt` (the text) to speech: Started, Audio..., Done


class ModelKind(WireEnum):
    """What a loaded model does (Ready.model_kind): which tasks its worker serves."""
    TEXT = "text"        # generate, tokenize, detokenize
    EMBED = "embed"      # embed, tokenize, detokenize
    RERANK = "rerank"    # score, tokenize, detokenize
    VISION = "vision"    # generate (images in the messages too), tokenize, detokenize
    STT = "stt"          # transcribe (speech to text, and translation into English)
    TTS = "tts"          # speak (text to speech)


TASKS_OF = {
    ModelKind.TEXT: frozenset({Task.GENERATE, Task.TOKENIZE, Task.DETOKENIZE}),
    ModelKind.EMBED: frozenset({Task.EMBED, Task.TOKENIZE, Task.DETOKENIZE}),
    ModelKind.RERANK: frozenset({Task.SCORE, Task.TOKENIZE, Task.DETOKENIZE}),
    ModelKind.VISION: frozenset({Task.GENERATE, Task.TOKENIZE, Task.DETOKENIZE}),
    ModelKind.STT: frozenset({Task.TRANSCRIBE}),
    ModelKind.TTS: frozenset({Task.SPEAK}),
}


_KIND_WORDS = {ModelKind.TEXT: "a text generation model", ModelKind.EMBED: "an embedding model",
               ModelKind.RERANK: "a reranker model", ModelKind.VISION: "a vision model",
               ModelKind.STT: "a speech recognition model",
               ModelKind.TTS: "a text-to-speech model"}
_TASK_WORDS = {Task.GENERATE: "generate text", Task.EMBED: "compute embeddings",
               Task.SCORE: "rerank documents", Task.TOKENIZE: "tokenize text",
               Task.DETOKENIZE: "detokenize token ids", Task.TRANSCRIBE: "transcribe audio",
               Task.SPEAK: "synthesise speech"}


def task_refusal(model: str | None, task: Task, kind: ModelKind) -> str:
    """Why `model` cannot do `task`: the same words from the supervisor (which refuses at
    admission once it knows the kind) and the worker (which refuses what came before)."""
    who = f"Model `{model}`" if model else "This model"
    return f"{who} is {_KIND_WORDS[kind]}: it cannot {_TASK_WORDS[task]}."


class ErrorCode(WireEnum):
    """What an Error is about; the supervisor maps each to an HTTP status."""
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_REQUEST = "invalid_request"
    LOAD_FAILED = "load_failed"
    INTERNAL = "internal_error"


# The names both sides have always imported.
FINISH_REASONS = tuple(r.value for r in FinishReason)
CONTEXT_LENGTH_EXCEEDED = ErrorCode.CONTEXT_LENGTH_EXCEEDED
INVALID_REQUEST = ErrorCode.INVALID_REQUEST
LOAD_FAILED = ErrorCode.LOAD_FAILED
INTERNAL = ErrorCode.INTERNAL


def _pack(typecode: str, values) -> bytes:
    a = array(typecode, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack(typecode: str, data: bytes) -> list:
    a = array(typecode)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def pack_ids(ids) -> bytes:
    """Token ids travel packed as little-endian uint32, not as a msgpack list of ints."""
    return _pack("I", ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("I", data)


def pack_floats(values) -> bytes:
    """Logprob arrays travel packed as little-endian float32, like token ids."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    return _unpack("f", data)
