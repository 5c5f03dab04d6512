"""A multimodal model's audio inputs (chat and Responses `input_audio` parts): whether
its checkpoint hears them, and the clips decoded as its processor takes them.

mlx-vlm reads audio with an audio tower: Gemma 4's (and 3n's, Qwen-Omni's, ...), whose
model has an `audio_tower` and whose processor a `feature_extractor` (mel frames at its
`sampling_rate`) and an audio placeholder it expands to one token per stretch of the
clip (Gemma 4: one per 40 ms, at most `audio_seq_length`). Such a worker reports the
capability at load (Ready.hears_audio); any other model refuses audio parts as it
refuses media it cannot read (worker/text/prompt.py).

A clip is decoded by the speech worker's decoder (worker/media/decode.py: PyAV, WAV,
MP3 and the rest) straight to mono float32 at the feature extractor's rate, no longer
than the processor turns into tokens: a longer clip is the client's 400, before any
feature is computed, rather than features the prompt's tokens do not cover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from protocol.messages import INVALID_REQUEST
from worker.errors import RequestError

# A clip's bound where the processor says none (Gemma 4's: 750 tokens of 40 ms).
DEFAULT_SECONDS = 30.0


@dataclass(frozen=True)
class Hearing:
    """How a model hears audio: its feature extractor's rate, the longest clip it takes."""
    rate: int
    max_seconds: float

    @classmethod
    def of(cls, vlm, processor) -> Optional["Hearing"]:
        """The model's hearing; None where its mlx-vlm class has no audio tower or its
        processor no feature extractor."""
        extractor = getattr(processor, "feature_extractor", None)
        if getattr(vlm, "audio_tower", None) is None or extractor is None:
            return None
        tokens = getattr(processor, "audio_seq_length", None)
        ms = getattr(processor, "audio_ms_per_token", None)
        seconds = tokens * ms / 1000 if tokens and ms else DEFAULT_SECONDS
        return cls(int(getattr(extractor, "sampling_rate", 16_000)), float(seconds))


def decode_clips(data: tuple[bytes, ...], hearing: Hearing) -> list:
    """The request's clips as float32 mono sample arrays at `hearing.rate`; a 400 naming
    the clip that does not decode or is longer than the model takes."""
    from worker.media.decode import decode_audio

    clips = []
    for i, raw in enumerate(data):
        try:  # (decoding stops past the bound: a long file is never decoded whole)
            clip = decode_audio(raw, hearing.rate, max_seconds=hearing.max_seconds)
        except RequestError as e:
            if e.message.startswith("The audio is longer"):
                raise _too_long(i, hearing) from None
            raise RequestError(INVALID_REQUEST, f"audio {i + 1} of the request: {e.message}",
                               "messages") from None
        if clip.size > hearing.max_seconds * hearing.rate:
            raise _too_long(i, hearing)
        clips.append(clip)
    return clips


def _too_long(i: int, hearing: Hearing) -> RequestError:
    return RequestError(INVALID_REQUEST, f"audio {i + 1} of the request is longer than this "
                        f"model's {hearing.max_seconds:g} s per clip: send it shorter",
                        "messages")
