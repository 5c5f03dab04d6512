"""An audio file as the model hears it: mono float32 samples at the model's rate.

PyAV (FFmpeg's decoders, bundled in its wheels) reads whatever a client sends — WAV,
FLAC, MP3, OGG (Vorbis, Opus), M4A/AAC, WebM — from bytes in memory, and its resampler
converts channels and rate in the same pass. It runs on the preparation thread: a long
file's decoding never holds the MLX thread. What it cannot read is the client's 400,
in words that say so without FFmpeg's internals.
"""

from __future__ import annotations

import io

import numpy as np

from protocol.messages import INVALID_REQUEST
from worker.errors import RequestError

# Decoded audio is ~20× the bytes of a compressed file: a 25 MB Opus file can hold a
# day of speech (gigabytes of samples). Past this, refuse rather than decode.
MAX_SECONDS = 4 * 3600


def decode_audio(data: bytes, rate: int, *, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """`data` (a whole file) as float32 mono samples at `rate` Hz."""
    import av

    if not data:
        raise _refusal("The audio file is empty.")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise _refusal("The file holds no audio stream.")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            pieces, total, limit = [], 0, int(max_seconds * rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    total += pieces[-1].size
                if total > limit:
                    raise _refusal(f"The audio is longer than {max_seconds / 3600:g} hours.")
            pieces.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    except RequestError:
        raise
    except (av.FFmpegError, ValueError, StopIteration, IndexError) as e:
        raise _refusal("The audio file could not be decoded: it is not a supported audio "
                       "format (WAV, FLAC, MP3, OGG, M4A, WebM) or it is damaged.") from e
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if audio.size == 0:
        raise _refusal("The audio file holds no samples.")
    return audio.astype(np.float32, copy=False)


def _refusal(message: str) -> RequestError:
    return RequestError(INVALID_REQUEST, message, "file")
