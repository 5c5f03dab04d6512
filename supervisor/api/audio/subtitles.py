"""A transcript's timed segments as subtitles: SubRip (srt) and WebVTT (vtt)."""

from __future__ import annotations

from protocol import Segment


def _clock(seconds: float, decimal: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def srt(segments: list[Segment]) -> str:
    cues = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate((s for s in segments if s.text.strip()), start=1)]
    return "\n".join(cues)


def vtt(segments: list[Segment]) -> str:
    cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n"
            for s in segments if s.text.strip()]
    return "WEBVTT\n\n" + "\n".join(cues)
