"""Synthesised speech (mono float32 PCM, as the worker sends it) in the format a client
asked for, encoded piece by piece as the audio arrives, so a response streams.

OpenAI's formats: `wav` and `pcm` are written here (a 44-byte header whose sizes say
"unknown", as a stream's must: the length is not known when it starts; raw 16-bit
little-endian samples); `mp3`, `opus` (in Ogg), `aac` (ADTS) and `flac` go through PyAV
(FFmpeg's encoders, bundled in its wheels), its muxer writing into a buffer drained after
each piece. `pcm` is 24 kHz, as OpenAI's is and as clients that play it assume; the others
keep the model's rate (their headers say it). Encoding runs in a thread (`asyncio.to_thread`
by the caller): an MP3 encoder is not work for the event loop.
"""

from __future__ import annotations

import io
import struct

import numpy as np

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac",
                 "flac": "audio/flac", "wav": "audio/wav", "pcm": "audio/pcm"}
PCM_RATE = 24000
_AV = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "aac": ("adts", "aac"),
       "flac": ("flac", "flac")}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


class Encoder:
    """`feed(samples)` → the bytes of `fmt` ready so far; `close()` → the rest."""

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self.in_rate = sample_rate
        self.rate = PCM_RATE if fmt == "pcm" else sample_rate
        if fmt == "opus" and self.rate not in _OPUS_RATES:
            self.rate = 48000
        self._header = fmt == "wav"
        self._resampler = self._container = None
        if self.rate != self.in_rate:
            import av

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate)
        if fmt in _AV:
            import av

            self._sink = _Sink()
            container, codec = _AV[fmt]
            self._container = av.open(self._sink, "w", format=container)
            self._stream = self._container.add_stream(codec, rate=self.rate)
            self._stream.layout = "mono"

    def feed(self, samples: np.ndarray) -> bytes:
        return self._encode(self._resampled(samples))

    def close(self) -> bytes:
        tail = self._encode(self._resampled(None)) if self._resampler is not None else b""
        if self._container is None:
            return tail
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return tail + self._sink.take()

    def _resampled(self, samples: np.ndarray | None) -> np.ndarray:
        if self._resampler is None:
            return samples
        import av

        frame = None
        if samples is not None:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt",
                                               layout="mono")
            frame.sample_rate = self.in_rate
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _encode(self, samples: np.ndarray) -> bytes:
        if self._container is None:
            pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
            if self._header:
                self._header = False
                return wav_header(self.rate) + pcm
            return pcm
        if samples.size:
            import av

            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, np.float32)
                                               .reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate = self.rate
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._sink.take()


def wav_header(rate: int, data_bytes: int = 0xFFFFFFFF) -> bytes:
    """A PCM WAV header (16-bit mono) for `data_bytes` of samples; the default says
    "unknown length", which players read as "until the end of the stream"."""
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


class _Sink(io.RawIOBase):
    """What the muxer writes, kept until taken (not seekable: a stream's muxer is
    written so it need not be)."""

    def __init__(self):
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._buf += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out
