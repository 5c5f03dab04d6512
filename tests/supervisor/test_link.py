"""The real link's stderr reader: any line length, bounded memory, never a dead reader."""

from __future__ import annotations

import asyncio
import sys

from supervisor.workers.link import stderr_lines


async def lines_of(data: bytes, max_line: int = 100) -> list[str]:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return [line async for line in stderr_lines(r, max_line)]


async def test_lines_of_any_length_are_read_and_cut():
    out = await lines_of(b"short\n" + b"x" * 300_000 + b"\nafter\n" + "é".encode() * 10
                         + b"\nlast")
    assert out[0] == "short" and out[2:] == ["after", "é" * 10, "last"]
    assert out[1].startswith("x" * 100 + "…") and "300000 bytes" in out[1]
    assert len(out[1]) < 200


async def test_a_process_writing_a_huge_line_is_read_to_its_end():
    # readline() would raise past 64 KiB, end the reader and let the pipe fill up: the
    # child would then block forever on its next write.
    code = ("import sys; sys.stderr.write('y' * 1_000_000 + '\\n'); sys.stderr.flush();"
            "[sys.stderr.write(f'line {i}\\n') for i in range(2000)]")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stderr=asyncio.subprocess.PIPE)
    out = [line async for line in stderr_lines(proc.stderr, 2000)]
    assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert "1000000 bytes" in out[0] and out[-1] == "line 1999" and len(out) == 2001
