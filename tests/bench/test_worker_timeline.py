"""bench/worker_timeline.py: a real server's worker traced while a wave of chats runs,
its lines merged with the client's on one clock."""

from __future__ import annotations

from bench import worker_timeline


def test_a_wave_is_traced_from_send_to_decode_and_the_gather_is_set():
    (wave,) = worker_timeline.run("tiny", "gemma4", waves=1, streams=3, tokens=4, gather=0.0)
    text = "\n".join(wave["lines"])
    assert wave["admitted"] == 3 and wave["tokens"] >= 3
    assert text.count("client sent #") == 3 and text.count("client first content #") == 3
    assert text.count("cmd Generate") == 3 and text.count("prepare ") == 3
    assert "step " in text and "waiting/prefilling/decoding" in text
    assert wave["gather"] == {"0.0"}  # MLXD_GATHER reached the worker's scheduler
    # Lines are in time order, each after the wave's start.
    times = [float(line.split()[0]) for line in wave["lines"]]
    assert times == sorted(times) and times[0] > -10.0
