"""Text to speech on mlx-audio's TTS models.

`prepare` (preparation thread) checks the voice; `run` (MLX thread) calls the model's own
`generate` and yields each piece of audio as it comes (`stream=True` where the family
streams: the scheduler sends every piece at once, so a client hears the start while the
rest is synthesised; a family that does not stream yields one piece per sentence or
segment, as its generate does).

Voices: a voice pack per file in the model's `voices/` folder (`voices/NAME.safetensors`,
Kokoro's convention, which mlx-audio's own server lists), else the names the model
itself lists. The first is the default; an unknown one is the client's 400, listing them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from protocol.messages import INVALID_REQUEST, Generate, ModelKind
from worker.errors import RequestError
from worker.text.tokens import check_task

DEFAULT_RATE = 24000
_VOICE_ATTRS = ("voices", "speakers", "available_voices")


@dataclass
class SpeakJob:
    text: str
    voice: str | None
    speed: float
    prompt_tokens: int = 0


class Synthesizer:
    """The engine of a TTS worker."""

    def __init__(self, model, path: Path):
        self.model = model
        self.sample_rate = int(getattr(model, "sample_rate", 0) or DEFAULT_RATE)
        self.voices = voices_of(model, Path(path))
        params = inspect.signature(model.generate).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._accepts = None if takes_any else set(params)
        # A family whose generate names no `speed` ignores it (Pocket TTS takes any
        # keyword): a speed it would not honour is refused rather than dropped.
        self.speeds = "speed" in params
        self.context_length = 0
        self.vocab_size = 0

    # ---- preparation thread --------------------------------------------------------------
    def prepare(self, gen: Generate) -> SpeakJob:
        check_task(gen, ModelKind.TTS)
        voice = gen.speech.voice
        if voice is not None and self.voices and voice not in self.voices:
            shown = ", ".join(self.voices[:50])
            raise RequestError(INVALID_REQUEST, f"Unknown voice {voice[:60]!r}: this model's "
                               f"voices are {shown}.", "voice")
        if gen.speech.speed != 1.0 and not self.speeds:
            raise RequestError(INVALID_REQUEST, "This model speaks at one speed: leave "
                               "`speed` at 1.", "speed")
        return SpeakJob(gen.prompt or "", voice or (self.voices[0] if self.voices else None),
                        gen.speech.speed, len((gen.prompt or "").split()))

    # ---- MLX thread ------------------------------------------------------------------------
    def run(self, job: SpeakJob) -> Iterator[np.ndarray]:
        """The audio of `job`, piece by piece (mono float32 at `sample_rate`)."""
        kwargs = {"voice": job.voice, "stream": True, "verbose": False}
        if self.speeds:
            kwargs["speed"] = job.speed
        if self._accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        if kwargs.get("voice") is None:
            kwargs.pop("voice", None)
        for result in self.model.generate(job.text, **kwargs):
            self.last_rate = int(getattr(result, "sample_rate", 0) or self.sample_rate)
            yield np.asarray(result.audio, dtype=np.float32).reshape(-1)

    def probe(self) -> None:
        """A short sentence through the model: before Ready (no first-request compile)
        and after a failed request (a step still runs, or WorkerBroken). The rate its
        audio comes at is the one Ready announces (a config may not say it)."""
        self.last_rate = self.sample_rate
        for _ in self.run(SpeakJob("Hello.", self.voices[0] if self.voices else None, 1.0)):
            pass
        self.sample_rate = self.last_rate


def voices_of(model, path: Path) -> list[str]:
    folder = path / "voices"
    if folder.is_dir():
        found = sorted(p.stem for p in folder.glob("*.safetensors"))
        if found:
            return found
    for attr in _VOICE_ATTRS:
        value = getattr(model, attr, None)
        if isinstance(value, dict):
            value = list(value)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
    return []
