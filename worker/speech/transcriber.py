"""Speech to text on mlx-audio's STT models (Whisper and the families it loads alike).

`prepare` (preparation thread) decodes the file to the model's rate; `run` (MLX thread)
calls the model's own `generate` once, on the whole audio, so long audio is cut into
windows by the model's own method (Whisper's 30-s seek loop, with its temperature
fallback and conditioning on the text so far), exactly as mlx-audio in-process does.

Whisper's loop is one call, so to stream and to stop it this hooks the one place it
reports between windows: its progress bar (`tqdm.tqdm(total=frames)`, updated after each
window's segments are committed). The hook reads the segments committed so far (the
loop's `all_segments`) and sends the new ones' text as a Delta, publishes the progress,
and takes commands: a Cancel of this request stops the loop there (`Stopped`). A family
whose generate reports nothing is still served, its text sent whole at the end.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from dataclasses import dataclass
from typing import Callable

from protocol.messages import INVALID_REQUEST, Generate, ModelKind, Segment, SpeechSpec, Word
from worker.errors import RequestError
from worker.media.decode import decode_audio
from worker.text.tokens import check_task

log = logging.getLogger("worker.speech")

SAMPLE_RATE = 16000  # what Whisper (and mlx-audio's STT families) listen at

try:  # ISO-639-1 code → the English name OpenAI's responses give ("en" → "english")
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES as _LANGUAGES
except ImportError:
    _LANGUAGES = {}


@dataclass
class TranscribeJob:
    audio: object                # float32 numpy samples at SAMPLE_RATE
    spec: SpeechSpec
    prompt: str | None
    temperature: float | None
    prompt_tokens: int = 0       # usage: transcription counts seconds, not tokens

    @property
    def duration(self) -> float:
        return self.audio.size / SAMPLE_RATE


@dataclass
class Transcribed:
    text: str
    language: str                # its English name, lower case ("english")
    segments: list[Segment]
    words: list[Word]
    tokens: int                  # what the model decoded (its segments' tokens)


class Transcriber:
    """The engine of an STT worker."""

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.generate).parameters
        self._accepts = set(params)
        self._fp32 = _float32_on_cpu(model)
        if self._fp32:
            self._accepts.add("fp16")  # Whisper's decode option (its **decode_options)
        # Whisper's tokenizer says whether the checkpoint is multilingual (an English-only
        # Whisper cannot translate: there is nothing to translate from).
        self.translates = "task" in params and bool(getattr(model, "is_multilingual", False))
        self.sample_rate = SAMPLE_RATE
        self.context_length = 0
        self.vocab_size = 0

    # ---- preparation thread --------------------------------------------------------------
    def prepare(self, gen: Generate) -> TranscribeJob:
        check_task(gen, ModelKind.STT)
        spec = gen.speech
        if spec.translate and not self.translates:
            raise RequestError(INVALID_REQUEST, "This model cannot translate: it is not a "
                               "multilingual speech model.", "model")
        if spec.language and not self._knows(spec.language):
            raise RequestError(INVALID_REQUEST, f"Unknown language {spec.language!r}: use an "
                               "ISO-639-1 code this model knows, such as 'en'.", "language")
        audio = decode_audio(gen.audio or b"", SAMPLE_RATE)
        return TranscribeJob(audio, spec, gen.prompt, gen.sampling.temperature)

    def _knows(self, language: str) -> bool:
        return not _LANGUAGES or language.lower() in _LANGUAGES

    # ---- MLX thread ------------------------------------------------------------------------
    def run(self, job: TranscribeJob, between: Callable[[list[str], float], None]) -> Transcribed:
        """Transcribe `job`. `between(texts, progress)` is called after each window
        with the text of the segments it committed (and may raise to stop)."""
        spec = job.spec
        hook = _WindowHook(between)
        with hook.installed(self.model):
            out = self.model.generate(job.audio, **self._kwargs(job))
        segments = out.segments or []
        if hook.sent < len(segments):  # what the hook did not stream (or all, unhooked)
            between([s.get("text", "") for s in segments[hook.sent:]], 1.0)
        return Transcribed(
            text=(out.text or "").strip(),
            language=_LANGUAGES.get(out.language or spec.language or "", out.language or ""),
            segments=[_segment(s) for s in segments] if spec.segments else [],
            words=[_word(w) for s in segments for w in s.get("words") or ()] if spec.words
            else [],
            tokens=sum(len(s.get("tokens") or ()) for s in segments))

    def probe(self) -> None:
        """A second of silence through the model: before Ready (no first-request compile)
        and after a failed request (a step still runs, or WorkerBroken)."""
        import numpy as np

        silence = TranscribeJob(np.zeros(SAMPLE_RATE, np.float32), SpeechSpec(language="en"),
                                None, None)
        self.model.generate(silence.audio, **self._kwargs(silence))

    def _kwargs(self, job: TranscribeJob) -> dict:
        """`generate`'s arguments for `job`, those this family takes."""
        spec = job.spec
        kwargs = {"verbose": None, "language": spec.language,
                  "task": "translate" if spec.translate else "transcribe",
                  "initial_prompt": job.prompt or None,
                  "word_timestamps": spec.words, "return_timestamps": True}
        if job.temperature is not None:
            kwargs["temperature"] = job.temperature
        if self._fp32:
            kwargs["fp16"] = False
        return {k: v for k, v in kwargs.items() if k in self._accepts}


def _float32_on_cpu(model) -> bool:
    """mlx-audio's Whisper loads in float16. MLX's CPU backend multiplies float16
    without BLAS (~5 GFLOP/s here against ~220 in float32 with OpenBLAS): on the CPU the
    model runs in float32, the same text 7× faster. Metal and CUDA keep float16."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or getattr(model, "dtype", None) != mx.float16:
        return False
    model.set_dtype(mx.float32)
    model.dtype = mx.float32
    return True


class _WindowHook:
    """Whisper's progress bar, replaced for one call (see the module's docstring)."""

    def __init__(self, between):
        self.between = between
        self.sent = 0           # segments already sent
        self.total = 0
        self.done = 0

    def installed(self, model):
        module = sys.modules.get(type(model).__module__)
        hook = self

        class Bar:
            def __init__(self, total=0, **_):
                hook.total = max(1, int(total or 0))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def update(self, n=1):
                hook.done += n
                segments = sys._getframe(1).f_locals.get("all_segments")
                texts = []
                if isinstance(segments, list):
                    texts = [s.get("text", "") for s in segments[hook.sent:]]
                    hook.sent = len(segments)
                hook.between(texts, min(1.0, hook.done / hook.total))

        return _Swapped(module, "tqdm", types.SimpleNamespace(tqdm=Bar))


class _Swapped:
    """`module.name = value` for the length of a with block (nothing if the module does
    not use `name`: a family without Whisper's loop)."""

    def __init__(self, module, name, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.old = getattr(self.module, self.name, None)
        if self.old is not None:
            setattr(self.module, self.name, self.value)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            setattr(self.module, self.name, self.old)
        return False


def _segment(s: dict) -> Segment:
    return Segment(float(s.get("start", 0.0)), float(s.get("end", 0.0)), s.get("text", ""),
                   float(s.get("temperature", 0.0)), float(s.get("avg_logprob", 0.0)),
                   float(s.get("compression_ratio", 0.0)), float(s.get("no_speech_prob", 0.0)),
                   int(s.get("seek", 0)), [int(t) for t in s.get("tokens") or ()])


def _word(w: dict) -> Word:
    return Word(str(w.get("word", "")), float(w.get("start", 0.0)), float(w.get("end", 0.0)))
