"""The supervisor↔worker protocol: typed messages, one msgpack codec, socket helpers.

Imports neither MLX nor aiohttp, so both sides (and tests) share it.
"""

from protocol.codec import EncodeError, ProtocolError, decode_down, decode_up, encode
from protocol.messages import (
    PROTOCOL_VERSION,
    CacheCommand,
    Audio,
    CacheReply,
    Cancel,
    Delta,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Heartbeat,
    ModelKind,
    OutputSpec,
    Pooled,
    PromptCache,
    Ready,
    SamplingParams,
    Segment,
    Shutdown,
    SpeechSpec,
    Started,
    Status,
    StatusRequest,
    TASKS_OF,
    Task,
    ToolCall,
    Tokens,
    Transcript,
    Word,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
)

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "EncodeError", "encode", "decode_down", "decode_up",
    "Generate", "SamplingParams", "OutputSpec", "PromptCache", "Cancel", "StatusRequest",
    "CacheCommand", "CacheReply", "Shutdown", "SpeechSpec",
    "Ready", "Started", "Delta", "Tokens", "Pooled", "Transcript", "Segment", "Word", "Audio",
    "Done", "Error", "Status", "Heartbeat",
    "FinishReason", "ErrorCode", "Task", "ModelKind", "TASKS_OF", "ToolCall", "pack_ids",
    "unpack_ids", "pack_floats", "unpack_floats",
]
