"""bench/stream_profile.py: py-spy's raw samples read back per thread, a thread's share of
the sampling passes turned into µs per generated token, and the frames counted as self
time (with the line that waited) and inclusive time (each function once per sample)."""

from __future__ import annotations

from bench.stream_profile import MLX_THREAD, Samples, Side

RAW = """\
thread (0x1a2b): MainThread;<module> (w.py:3);step (lean.py:81);model (m.py:9) 30
thread (0x1a2b): MainThread;<module> (w.py:3);step (lean.py:88) 60
thread (0x1a2b): MainThread;<module> (w.py:3);step (lean.py:88);step (lean.py:90) 10
thread (77): link-send;loop (link.py:133) 100
not a sample line
"""


def test_samples_by_thread_self_and_inclusive(tmp_path):
    path = tmp_path / "served.worker.txt"
    path.write_text(RAW)
    s = Samples(path)
    assert set(s.threads) == {MLX_THREAD, "link-send"}
    assert s.passes() == 100  # (--idle: every thread in every pass)
    own = s.self_time(MLX_THREAD)
    assert own == {"model (m.py:9)": 30, "step (lean.py:88)": 60, "step (lean.py:90)": 10}
    inc = s.inclusive(MLX_THREAD)
    # a function twice on one stack (a recursion, two lines of one frame) counts once
    assert inc["step (lean.py)"] == 100 and inc["<module> (w.py)"] == 100
    assert inc["model (m.py)"] == 30


def test_a_threads_share_of_the_passes_is_its_share_of_the_wall_time_per_token(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text(RAW)
    side = Side("served")
    side.procs["worker"] = Samples(path)
    side.tokens, side.wall = 500, 2.0  # 4 ms a token
    assert side.us_per_token("worker", 100) == 4000.0
    assert side.us_per_token("worker", 60) == 2400.0
    gil = tmp_path / "x.gil.txt"
    gil.write_text("thread (0x1a2b): MainThread;step (lean.py:88) 50\n")
    side.gil["worker"] = Samples(gil)
    # 50 samples at 250 a second: 0.2 s over 500 tokens
    assert side.gil_us_per_token("worker", MLX_THREAD, 250) == 400.0
    assert side.gil_us_per_token("worker", "link-send", 250) == 0.0
