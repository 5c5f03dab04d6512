"""Message types of the supervisor↔worker protocol (DESIGN.md, "Protocol").

Every message is a frozen, keyword-only `msgspec.Struct`, tagged: on the wire it is a
msgpack map whose "type" is the message's kind (its tag), then "v" (the protocol version),
then its fields in declaration order. msgspec encodes and validates them in C (a one-token
Delta: ~0.3 µs to encode, ~0.6 µs to decode, against 3.6 µs and 13.1 µs for the hand-written
dataclass codec this replaced), so the types here ARE the schema: what a field's type says
is checked when a frame is decoded (protocol/codec.py).
Their enums and packed arrays are in protocol/wire.py, the counters they carry in
protocol/stats.py.

Down (supervisor → worker): Generate, Cancel, StatusRequest, CacheCommand, Shutdown.
Up (worker → supervisor): Ready, Started, Delta, Tokens, Pooled, Done, Error, Status,
CacheReply, Heartbeat.
Up messages carry the worker's `epoch` (its incarnation): events of a dead epoch are dropped.

A `Generate` is one complete request, built once by the API surface that received it
(supervisor/api/fields/generate.py) with the server's defaults applied; the dispatcher only
stamps its `rid`. Sampling options live in `SamplingParams`, what the output must look like
in `OutputSpec`: a new option is one field there plus its parsing.

`Generate` is the one request struct, whatever it computes (like vLLM's one request type
with sampling or pooling parameters): its `task` says what. Every task goes through the
same queue, retry, cancel and timeout machinery and ends with exactly one Done; what it
computes comes before that Done, in the task's own message (Delta for generation, Tokens
for tokenize/detokenize, Pooled for embeddings and rerank scores).

Compatibility rule: a new field gets a default and goes at the end of its class (an older
peer's frame lacks it and decodes to the default; a newer peer's unknown fields are
ignored). A change that breaks this, or a new enum value, bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import msgspec

# (Re-exported: both sides import these from protocol.messages.)
from protocol.stats import (  # noqa: F401
    CacheStats, GroupInfo, GroupRank, KVStats, SnapshotInfo, SnapshotStats, SpeculationStats)
from protocol.wire import (  # noqa: F401
    CONTEXT_LENGTH_EXCEEDED, FINISH_REASONS, INTERNAL, INVALID_REQUEST, LOAD_FAILED, TASKS_OF,
    ErrorCode, FinishReason, ModelKind, Task, WireEnum, pack_floats, pack_ids, task_refusal,
    unpack_floats, unpack_ids)

PROTOCOL_VERSION = 7  # 3: Generate.task, Tokens, Pooled, Ready.model_kind; 4: KV snapshots
#                       (Generate.snapshot/resume, CacheCommand, CacheReply);
#                       5: Generate.images, ModelKind.VISION; 6: speech (Task.TRANSCRIBE
#                       and SPEAK, Generate.audio and .speech, Transcript, Audio,
#                       Ready.voices/sample_rate, progress in Status and Heartbeat);
#                       7: Generate.cache (a PromptCache) replaces Generate.cache_key,
#                       .snapshot and .resume. Not additive: a version-6 worker would
#                       ignore `cache` and lose the namespace and the snapshot names
#                       (answering from the wrong namespace, keeping nothing), and a
#                       version-7 one would ignore a version-6 peer's three fields; so the
#                       versions refuse each other. PromptCache itself follows the rule
#                       above: a new field gets a default and goes at its end.


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """One parsed tool call (not a message: an item of Delta.tool_calls). Independent of
    any API's JSON shape; chat completions and the Responses API each render it.
    On the wire it is the list [index, id, name, arguments]."""
    index: int        # 0, 1, ... in the order the model made the calls
    id: str           # "call_..." (or the model's own id, when its format has one)
    name: str
    arguments: str    # a JSON object, as text

    def to_wire(self) -> list:
        return [self.index, self.id, self.name, self.arguments]

    @classmethod
    def from_wire(cls, item) -> "ToolCall":
        """A ToolCall from its wire list. Decoded Deltas already hold ToolCalls (returned
        as they are), so readers need not call this."""
        if isinstance(item, cls):
            return item
        if not (isinstance(item, (list, tuple)) and len(item) == 4
                and isinstance(item[0], int) and all(isinstance(x, str) for x in item[1:])):
            raise ValueError(f"not a tool call: {item!r}")
        return cls(item[0], item[1], item[2], item[3])


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every message: the tag ("type") is its kind, `v` the protocol version."""
    v: int = PROTOCOL_VERSION

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag


# ---- down: supervisor → worker -------------------------------------------------------

class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How the next token is chosen. None: the worker's (mlx-lm's) default."""
    max_tokens: Optional[int] = None      # None: up to the context length
    temperature: Optional[float] = None   # None: 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None           # 0 or None: off
    min_p: Optional[float] = None
    seed: Optional[int] = None            # any int64
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # (token id, bias) pairs: ids stay ints (JSON object keys are strings).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # max_tokens is a ceiling, not a demand: a prompt that leaves less room gets what the
    # context leaves, instead of a 400 (Anthropic's clients send max_tokens far beyond a
    # small model's context: Claude Code asks for 32000 on every turn).
    max_tokens_ceiling: bool = False


class OutputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must look like, and what comes with it."""
    stop: tuple[str, ...] = ()            # up to 4 strings, never returned in text
    logprobs: bool = False                # per-token logprobs in the Deltas
    top_logprobs: int = 0                 # alternatives per token (0..20)
    response_format: Optional[Literal["json_object", "json_schema"]] = None  # None: text
    json_schema: Optional[dict[str, Any]] = None  # the schema of "json_schema"
    # Tools, in chat completions' nested form ({"type": "function", "function": {...}}):
    # rendered by the chat template, read by the tool-call parser and the grammar.
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Literal["none", "auto", "required"]] = None  # None: auto
    allowed_tools: Optional[tuple[str, ...]] = None  # names a call may use; None: all
    parallel_tool_calls: bool = True
    reasoning_effort: Optional[str] = None  # mapped onto the template's thinking switch
    # The prompt comes back first (a legacy completion's `echo`): a Delta with its text and
    # no token ids, and with `logprobs` each prompt token's logprob under the model (NaN
    # for the first: nothing before it predicts it) and its alternatives (worker/loop/echo.py).
    echo: bool = False


class SpeechSpec(msgspec.Struct, frozen=True, kw_only=True):
    """TRANSCRIBE's and SPEAK's options (TRANSCRIBE also reads sampling.temperature, and
    `prompt` as the text that conditions it: a vocabulary, the previous sentences)."""
    language: Optional[str] = None    # TRANSCRIBE: the spoken language (ISO-639-1); None:
    #                                   the model detects it
    translate: bool = False           # TRANSCRIBE: into English (/v1/audio/translations)
    segments: bool = False            # TRANSCRIBE: timed segments in the Transcript
    words: bool = False               # TRANSCRIBE: timed words too
    voice: Optional[str] = None       # SPEAK: one of Ready.voices; None: the model's first
    speed: float = 1.0                # SPEAK: 0.25 .. 4


class PromptCache(msgspec.Struct, frozen=True, kw_only=True):
    """What a request asks of the worker's KV cache (worker/kvcache/manager.py), built by
    one helper for every surface (supervisor/api/fields/generate.py `prompt_cache`).
    The names are opaque to the worker: it never reads a meaning into them."""
    # The prompt cache's namespace (the client's `prompt_cache_key`): prefixes stored under
    # one namespace are reused only by requests with it. None: the shared namespace.
    namespace: Optional[str] = None
    # Keep the state this generation ends with under this name (in memory and on disk).
    keep_as: Optional[str] = None
    # Start from the state kept under this name when its tokens begin this prompt.
    resume_from: Optional[str] = None
    # What the worker's logs may call `resume_from` (a name can be a client's secret);
    # "": "a named snapshot".
    resume_label: str = ""
    # Requests that follow with this same prompt (a request's other `n` choices): the
    # worker keeps the prompt's state for them when its prefill ends.
    repeats: int = 0


class Generate(Message, frozen=True, kw_only=True, tag="generate"):
    """Generate for one request. Exactly one of `messages` (chat) and `prompt` (text
    completion) is set; `prompt_ids` (packed) replaces `prompt` when the client sent
    token ids. Values arrive validated by the API surface."""
    rid: str
    messages: Optional[list[dict[str, Any]]] = None  # [{"role": str, "content": str, ...}]
    prompt: Optional[str] = None
    prompt_ids: Optional[bytes] = None
    sampling: SamplingParams = SamplingParams()
    output: OutputSpec = OutputSpec()
    template_kwargs: Optional[dict[str, Any]] = None
    log_prompt: bool = False              # the worker may log prompt text only if set
    cache: PromptCache = PromptCache()    # the prompt cache: namespace, snapshot names
    task: Task = Task.GENERATE
    # EMBED: the texts to embed; SCORE: the documents, scored against `prompt`.
    inputs: Optional[list[str]] = None
    input_ids: Optional[list[bytes]] = None  # EMBED given token ids: one packed list each
    dimensions: Optional[int] = None      # EMBED: keep this many leading dimensions
    #                                       (Matryoshka), renormalised
    # VISION: the images of `messages`, as sent (file bytes: PNG, JPEG, ...), in the order
    # of the {"type": "image"} parts of the messages' content lists; the worker decodes
    # them (an undecodable one is the client's 400).
    images: tuple[bytes, ...] = ()
    # TRANSCRIBE: the audio file as sent (WAV, FLAC, MP3, OGG, M4A, ...): the worker decodes
    # it (one it cannot decode is the client's 400).
    audio: Optional[bytes] = None
    speech: SpeechSpec = SpeechSpec()
    # Predicted Outputs: text the completion is expected to mostly repeat (a file being
    # edited); the worker drafts from it (worker/speculative/). Never changes the output.
    prediction: Optional[str] = None
    # VISION: the audio clips of `messages` (chat and Responses `input_audio`), as sent
    # (WAV, MP3 bytes), in the order of their {"type": "audio"} parts; a model whose
    # mlx-vlm class hears them decodes them, any other refuses them (worker/text/prompt.py).
    audios: tuple[bytes, ...] = ()
    # A raw `prompt` is tokenized with the tokenizer's own special tokens (its BOS, unless
    # the text starts with it), as mlx-lm's generate does; False: the text's tokens alone
    # (vLLM's `add_special_tokens`, which lm-evaluation-harness's tokenizer calls send).
    special_tokens: bool = True


# How an image (an audio clip) a model cannot see (hear) stands in a conversation's
# history, on both sides: the API surfaces' (supervisor/api/fields/media.py) and a
# worker's (worker/text/prompt.py).
IMAGE_PLACEHOLDER = "[image]"
AUDIO_PLACEHOLDER = "[audio]"


class Cancel(Message, frozen=True, kw_only=True, tag="cancel"):
    """Drop `rid` at the next decode step or prefill chunk. Idempotent; a Done with
    finish_reason "cancelled" answers it (unless the request had already finished)."""
    rid: str


class StatusRequest(Message, frozen=True, kw_only=True, tag="status"):
    qid: int = 0  # echoed in the Status reply


class CacheCommand(Message, frozen=True, kw_only=True, tag="cache"):
    """Administer the KV snapshots (mlxctl cache): "ls" lists them, "save" writes `name`'s
    state to the disk tier, "drop" forgets `name` in every tier, "clear" forgets them all
    (and the prompt-prefix cache). Answered by a CacheReply with the same qid."""
    qid: int
    op: Literal["ls", "save", "drop", "clear"]
    name: Optional[str] = None


class Shutdown(Message, frozen=True, kw_only=True, tag="shutdown"):
    """Cooperative stop: cancel everything, answer each with Done, then exit."""


# ---- up: worker → supervisor ---------------------------------------------------------

class Ready(Message, frozen=True, kw_only=True, tag="ready"):
    """Model loaded and warmed; the worker takes Generate from now on."""
    epoch: int
    model: str
    context_length: int
    pid: int
    slots: int = 1                 # sequences the worker runs at once
    random_weights: bool = False   # a demo/test model: output is meaningless
    active_bytes: int = 0          # MLX memory in use after loading
    peak_bytes: int = 0
    vocab_size: int = 0            # the logits' width: token ids (top_k, logit_bias) < this
    model_kind: ModelKind = ModelKind.TEXT  # which tasks it serves (TASKS_OF)
    dimensions: int = 0            # EMBED: the vector width
    voices: list[str] = []         # TTS: the voices SPEAK takes (the first is the default)
    sample_rate: int = 0           # TTS: of its Audio; STT: what it resamples input to
    translates: bool = False       # STT: TRANSCRIBE may translate into English
    group: Optional[GroupInfo] = None  # a worker group: its ranks (None: one process)
    hears_audio: bool = False      # VISION: takes audio parts (Generate.audios)
    # Its tokenizer's special tokens and chat template, for `/tokenizer_info` (empty where
    # it has none: speech): worker/text/tokens.py `info`.
    tokenizer: dict[str, Any] = {}


class Started(Message, frozen=True, kw_only=True, tag="started"):
    """Prompt tokenized and checked; prefill begins."""
    epoch: int
    rid: str
    prompt_tokens: int
    cached_tokens: int = 0


class Delta(Message, frozen=True, kw_only=True, tag="delta"):
    """All output of one or more decode steps for one request (steps faster than the
    stream interval share one Delta: text is concatenated, per-token arrays are packed back
    to back, each aligned with `token_ids`).

    `text` is the answer only: reasoning goes to `reasoning`, tool-call markup never
    appears in either; each complete call comes once in `tool_calls`."""
    epoch: int
    rid: str
    text: str
    token_ids: bytes = b""  # packed (pack_ids)
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    logprobs: bytes = b""       # float32 per token (pack_floats); empty unless asked
    top_ids: bytes = b""        # uint32, OutputSpec.top_logprobs per token
    top_logprobs: bytes = b""   # float32, aligned with top_ids
    token_bytes: list[bytes] = []  # per token: its bytes, then its alternatives' bytes
    #                                (1 + top each)
    # The tool call the output ran out of tokens inside (last Delta only): its name and
    # its arguments as far as they got, not valid JSON; never in `tool_calls`. (A short
    # name: every Delta carries it.)
    cut: Optional[ToolCall] = None

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


class Tokens(Message, frozen=True, kw_only=True, tag="tokens"):
    """The result of TOKENIZE (`ids`, and the pieces each id decodes to) or DETOKENIZE
    (`text`)."""
    epoch: int
    rid: str
    ids: bytes = b""              # packed (pack_ids)
    pieces: list[bytes] = []      # TOKENIZE: each id's bytes (a piece may be part of a
    #                               UTF-8 character)
    text: str = ""

    def id_list(self) -> list[int]:
        return unpack_ids(self.ids)


class Pooled(Message, frozen=True, kw_only=True, tag="pooled"):
    """The result of EMBED (one vector per input) or SCORE (one score per document): a
    float32 matrix of `rows` × `dim`, row-major, packed like logprobs."""
    epoch: int
    rid: str
    rows: int
    dim: int
    data: bytes = b""             # float32 (pack_floats), rows * dim values
    tokens: list[int] = []        # prompt tokens per row (usage; truncation visible)

    def matrix(self) -> list[list[float]]:
        values = unpack_floats(self.data)
        return [values[i * self.dim:(i + 1) * self.dim] for i in range(self.rows)]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A timed stretch of a Transcript (seconds from the audio's start)."""
    start: float
    end: float
    text: str
    temperature: float = 0.0      # what decoding it took (a fallback raises it)
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    seek: int = 0                 # the window it was decoded in (mel frames)
    tokens: list[int] = []


class Word(msgspec.Struct, frozen=True, array_like=True):
    word: str
    start: float
    end: float


class Transcript(Message, frozen=True, kw_only=True, tag="transcript"):
    """TRANSCRIBE's result, just before its Done: the whole text (the Deltas streamed it
    stretch by stretch), the language, the audio's length, and timed segments and words
    when SpeechSpec asked for them."""
    epoch: int
    rid: str
    text: str
    language: str = ""
    duration: float = 0.0         # seconds of audio
    segments: list[Segment] = []
    words: list[Word] = []


class Audio(Message, frozen=True, kw_only=True, tag="audio"):
    """SPEAK's output as it is produced: mono PCM, float32 (pack_floats) in -1..1."""
    epoch: int
    rid: str
    sample_rate: int
    data: bytes = b""

    @property
    def samples(self) -> int:
        return len(self.data) // 4


class Done(Message, frozen=True, kw_only=True, tag="done"):
    """The one terminal message of every Generate."""
    epoch: int
    rid: str
    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0   # of completion_tokens, those spent reasoning
    stop_sequence: Optional[str] = None  # the stop string that ended it ("stop" only)
    # Predicted Outputs (worker/speculative/): tokens drafted from the request's prediction
    # that the model accepted, and those it rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Error(Message, frozen=True, kw_only=True, tag="error"):
    """An error safe to show to the client. With a `rid` it concerns that request and a
    Done(finish_reason="error") follows; without, it concerns the worker (load failed)."""
    epoch: int
    code: ErrorCode
    message: str
    rid: Optional[str] = None
    param: Optional[str] = None


class Status(Message, frozen=True, kw_only=True, tag="status"):
    """Answer to StatusRequest."""
    epoch: int
    qid: int
    state: str                     # loading | ready | busy | draining
    active: list[str] = []         # rids being prefilled or decoded
    waiting: list[str] = []        # rids accepted, not started
    steps: int = 0                 # decode steps + prefill chunks since start
    active_bytes: int = 0
    peak_bytes: int = 0
    prompt_cache: Optional["CacheStats"] = None
    progress: Optional[float] = None  # 0..1 of the running request, where known in advance
    #                                   (a transcription: the audio decoded so far)


class CacheReply(Message, frozen=True, kw_only=True, tag="cache_reply"):
    """Answer to CacheCommand."""
    epoch: int
    qid: int
    ok: bool = True
    message: str = ""           # what was done, or why not (`ok` false: unknown name, ...)
    entries: list[SnapshotInfo] = []


class Heartbeat(Message, frozen=True, kw_only=True, tag="heartbeat"):
    """Sent by the worker's I/O thread about once a second, also while the MLX thread is
    busy in a long step: `steps` not advancing while busy is how a hang is seen."""
    epoch: int
    state: str
    steps: int = 0
    active: int = 0
    waiting: int = 0
    active_bytes: int = 0
    peak_bytes: int = 0
    # MLX's buffer cache: freed buffers the process keeps for reuse, memory it holds all
    # the same (active + cache is what it takes from the machine; 0 from older workers).
    cache_bytes: int = 0
    prompt_cache: Optional[CacheStats] = None  # None: the worker has no prompt cache
    kv: Optional[KVStats] = None  # None: an engine without a KV batch (or an older worker)
    load_progress: Optional[float] = None  # 0..1 while a model is converted (GGUF) at load
    progress: Optional[float] = None       # as Status.progress
    speculation: Optional[SpeculationStats] = None  # None: the worker does not speculate
    # A worker group's leader: seconds since the quietest other rank was last heard from
    # (None: one process). A rank that hangs or dies shows here.
    group_silence: Optional[float] = None
    # ... and each other rank's MLX memory as its last beat said: [rank, active, peak].
    group_memory: list[tuple[int, int, int]] = []


DOWN = (Generate, Cancel, StatusRequest, CacheCommand, Shutdown)
UP = (Ready, Started, Delta, Tokens, Pooled, Transcript, Audio, Done, Error, Status, CacheReply,
      Heartbeat)
