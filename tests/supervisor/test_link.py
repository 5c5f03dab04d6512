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


async def test_the_events_socket_yields_every_frame_in_order_and_then_closes(tmp_path):
    # The link reads its events socket with one reader for its life (ZMQ's descriptor is
    # edge-triggered): frames that arrive while nothing waits, several per wake-up, must all
    # come out, in order, and a recv() waiting when the link closes must end.
    import zmq
    import zmq.asyncio

    from protocol import Heartbeat, encode
    from protocol.sockets import push
    from supervisor.workers.link import LinkClosed, ProcessLink

    ctx = zmq.asyncio.Context()
    link = ProcessLink(epoch=1, model="m", name="m", runtime_dir=tmp_path, ctx=ctx,
                       worker_args=[], python="/bin/true")  # no worker: the socket is ours
    await link.start()
    sender = push(zmq.Context.instance(), link._endpoints.events, bind=False)
    try:
        got = []
        for burst in range(20):
            for i in range(burst % 4 + 1):
                sender.send(encode(Heartbeat(epoch=1, state="ready", steps=len(got) + i)))
            await asyncio.sleep(0.002 * (burst % 3))
            want = len(got) + burst % 4 + 1
            while len(got) < want:
                got += await asyncio.wait_for(link.recv(), 5)
        assert [m.steps for m in got] == list(range(len(got))) and len(got) == 50
        waiting = asyncio.create_task(link.recv())
        await asyncio.sleep(0.01)
        link.close()
        try:
            await asyncio.wait_for(waiting, 5)
            raise AssertionError("recv() returned on a closed link")
        except LinkClosed:
            pass
    finally:
        sender.close(linger=0)
        link.close()
        await link.wait()
        ctx.term()
