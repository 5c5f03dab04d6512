"""Message types of the supervisor↔worker protocol (DESIGN.md, "Protocol").

Every message is a frozen dataclass with a `kind` class attribute (its wire `type`).
Down (supervisor → worker): Generate, Cancel, StatusRequest, Shutdown.
Up (worker → supervisor): Ready, Started, Delta, Done, Error, Status, Heartbeat.
Up messages carry the worker's `epoch` (its incarnation): events of a dead epoch are dropped.

Compatibility rule: a new field gets a default and goes at the end of its class.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import ClassVar, Optional

PROTOCOL_VERSION = 1

# Finish reasons a Done may carry.
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")

# Error codes a worker may send; the supervisor maps them to HTTP statuses.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_REQUEST = "invalid_request"
LOAD_FAILED = "load_failed"
INTERNAL = "internal_error"


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


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call (not a message: an item of Delta.tool_calls). Independent of
    any API's JSON shape; chat completions and the Responses API each render it.
    On the wire it is the list [index, id, name, arguments] (to_wire/from_wire)."""
    index: int        # 0, 1, ... in the order the model made the calls
    id: str           # "call_..." (or the model's own id, when its format has one)
    name: str
    arguments: str    # a JSON object, as text

    def to_wire(self) -> list:
        return [self.index, self.id, self.name, self.arguments]

    @classmethod
    def from_wire(cls, item) -> "ToolCall":
        if not (isinstance(item, (list, tuple)) and len(item) == 4
                and isinstance(item[0], int) and all(isinstance(x, str) for x in item[1:])):
            raise ValueError(f"not a tool call: {item!r}")
        return cls(item[0], item[1], item[2], item[3])


# ---- down: supervisor → worker -------------------------------------------------------

@dataclass(frozen=True)
class Generate:
    """Generate for one request. Exactly one of `messages` (chat) and `prompt` (text
    completion) is set; `prompt_ids` (packed) replaces `prompt` when the client sent
    token ids. Sampling values arrive validated; the worker applies its own defaults to
    what is None."""
    kind: ClassVar[str] = "generate"
    rid: str
    messages: Optional[list] = None       # [{"role": str, "content": str, ...}]
    prompt: Optional[str] = None
    prompt_ids: Optional[bytes] = None
    max_tokens: Optional[int] = None      # None: up to the context length
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    stop: list = field(default_factory=list)  # up to 4 strings, never returned in text
    template_kwargs: Optional[dict] = None
    log_prompt: bool = False              # the worker may log prompt text only if set
    # Tools, in chat completions' nested form ({"type": "function", "function": {...}}):
    # rendered by the chat template, read by the tool-call parser and the grammar.
    tools: Optional[list] = None
    tool_choice: Optional[str] = None     # "none" | "auto" | "required"; None: auto
    allowed_tools: Optional[list] = None  # names a call may use (named choice: one); None: all
    parallel_tool_calls: bool = True
    response_format: Optional[str] = None  # None | "text" | "json_object" | "json_schema"
    json_schema: Optional[dict] = None    # the schema of "json_schema"
    logprobs: bool = False                # per-token logprobs in the Deltas
    top_logprobs: int = 0                 # alternatives per token (0..20)
    logit_bias: Optional[list] = None     # [[token id, bias], ...] (msgpack keys are strings)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    reasoning_effort: Optional[str] = None  # mapped onto the template's thinking switch


@dataclass(frozen=True)
class Cancel:
    """Drop `rid` at the next decode step or prefill chunk. Idempotent; a Done with
    finish_reason "cancelled" answers it (unless the request had already finished)."""
    kind: ClassVar[str] = "cancel"
    rid: str


@dataclass(frozen=True)
class StatusRequest:
    kind: ClassVar[str] = "status"
    qid: int = 0  # echoed in the Status reply


@dataclass(frozen=True)
class Shutdown:
    """Cooperative stop: cancel everything, answer each with Done, then exit."""
    kind: ClassVar[str] = "shutdown"


# ---- up: worker → supervisor ---------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    """Model loaded and warmed; the worker takes Generate from now on."""
    kind: ClassVar[str] = "ready"
    epoch: int
    model: str
    context_length: int
    pid: int
    slots: int = 1                 # sequences the worker runs at once
    random_weights: bool = False   # a demo/test model: output is meaningless
    active_bytes: int = 0          # MLX memory in use after loading
    peak_bytes: int = 0
    vocab_size: int = 0            # the logits' width: token ids (top_k, logit_bias) < this


@dataclass(frozen=True)
class Started:
    """Prompt tokenized and checked; prefill begins."""
    kind: ClassVar[str] = "started"
    epoch: int
    rid: str
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """All output of one or more decode steps for one request (steps faster than the
    stream interval share one Delta: text is concatenated, per-token arrays are packed back
    to back, each aligned with `token_ids`).

    `text` is the answer only: reasoning goes to `reasoning`, tool-call markup never
    appears in either; each complete call comes once in `tool_calls`."""
    kind: ClassVar[str] = "delta"
    epoch: int
    rid: str
    text: str
    token_ids: bytes = b""  # packed (pack_ids)
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # ToolCall.to_wire() each
    logprobs: bytes = b""       # float32 per token (pack_floats); empty unless asked
    top_ids: bytes = b""        # uint32, Generate.top_logprobs per token
    top_logprobs: bytes = b""   # float32, aligned with top_ids
    token_bytes: list = field(default_factory=list)  # per token: its bytes, then its
    #                                                  alternatives' bytes (1 + top each)

    # Readers ask the message, never do byte arithmetic on its packed fields.
    @property
    def n_tokens(self) -> int:
        """How many tokens this Delta carries."""
        return len(self.token_ids) // 4

    def ids(self) -> list[int]:
        return unpack_ids(self.token_ids)

    def logprob_rows(self) -> list[tuple[bytes, float, list[tuple[bytes, float]]]]:
        """Per token: (its bytes, its logprob, [(alternative's bytes, logprob)] best
        first). Empty unless the request asked for logprobs."""
        if not self.logprobs:
            return []
        values = unpack_floats(self.logprobs)
        top_lp = unpack_floats(self.top_logprobs) if self.top_logprobs else []
        k = len(top_lp) // len(values)
        raw = self.token_bytes
        rows = []
        for i, lp in enumerate(values):
            base = i * (k + 1)
            tok = raw[base] if base < len(raw) else b""
            top = [(raw[base + 1 + j], top_lp[i * k + j]) for j in range(k)
                   if base + 1 + j < len(raw)]
            rows.append((tok, lp, top))
        return rows


@dataclass(frozen=True)
class Done:
    """The one terminal message of every Generate."""
    kind: ClassVar[str] = "done"
    epoch: int
    rid: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0   # of completion_tokens, those spent reasoning


@dataclass(frozen=True)
class Error:
    """An error safe to show to the client. With a `rid` it concerns that request and a
    Done(finish_reason="error") follows; without, it concerns the worker (load failed)."""
    kind: ClassVar[str] = "error"
    epoch: int
    code: str
    message: str
    rid: Optional[str] = None
    param: Optional[str] = None


@dataclass(frozen=True)
class Status:
    """Answer to StatusRequest."""
    kind: ClassVar[str] = "status"
    epoch: int
    qid: int
    state: str                     # loading | ready | busy | draining
    active: list = field(default_factory=list)   # rids being prefilled or decoded
    waiting: list = field(default_factory=list)  # rids accepted, not started
    steps: int = 0                 # decode steps + prefill chunks since start
    active_bytes: int = 0
    peak_bytes: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """Sent by the worker's I/O thread about once a second, also while the MLX thread is
    busy in a long step: `steps` not advancing while busy is how a hang is seen."""
    kind: ClassVar[str] = "heartbeat"
    epoch: int
    state: str
    steps: int = 0
    active: int = 0
    waiting: int = 0
    active_bytes: int = 0
    peak_bytes: int = 0


DOWN = (Generate, Cancel, StatusRequest, Shutdown)
UP = (Ready, Started, Delta, Done, Error, Status, Heartbeat)
