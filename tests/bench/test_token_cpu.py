"""bench/token_cpu.py: per-token CPU split by thread (what `bench.single_ab --cpu` prints),
CPU burnt on the calling thread and on another thread counted apart, per generated token,
and each side's total over raw's."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
import time

import psutil

from bench.token_cpu import TokenCPU, _threads


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_calling_thread_and_the_others_are_counted_apart_per_token():
    # In a fresh process: a process's other threads are counted whole, and threads that
    # earlier tests left spinning here (OpenBLAS's, after numpy's work, unless
    # OPENBLAS_NUM_THREADS=1) would be counted with the one this test starts.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(
            "spawn")) as pool:
        pool.submit(_counted_apart).result(timeout=120)


def _counted_apart():
    cpu = TokenCPU()

    def run():
        other = threading.Thread(target=burn, args=(0.05,))
        other.start()
        burn(0.02)
        other.join()
        return "out"

    assert cpu.local("raw", run, tokens=10) == "out"
    assert cpu.local("in-process", lambda: burn(0.04), tokens=10) is None
    raw, ours = cpu.rounds["raw"], cpu.rounds["in-process"]
    # µs per token: 20 ms / 10 tokens on this thread, 50 ms / 10 on the other
    assert 2000 <= raw["MLX thread"][0] < 2600 and 5000 <= raw["other threads"][0] < 6000
    assert 4000 <= ours["MLX thread"][0] < 4600 and ours["other threads"][0] < 600
    rows = dict((side, total) for side, _, total in cpu.rows())
    assert "(1.000 x raw)" in rows["raw"]
    ratio = float(rows["in-process"].split("(")[1].split(" x")[0])
    assert 0.5 < ratio < 0.8  # ~4.1 ms against ~7.1 ms a token


def test_another_process_threads_are_read_finer_than_a_clock_tick():
    """A server's threads are read from outside (psutil, or /proc on Linux): 3 ms burnt
    on one thread reads as 3 ms, not as 0 or 10 (a clock tick, psutil's unit on Linux)."""
    me = psutil.Process()
    go, burnt, leave = threading.Event(), threading.Event(), threading.Event()
    ident = []

    def work():
        ident.append(threading.get_native_id())
        go.wait()
        burn(0.003)
        burnt.set()
        leave.wait()

    t = threading.Thread(target=work)
    t.start()
    while not ident:
        time.sleep(0.001)
    before = _threads(me)[ident[0]]
    go.set()
    burnt.wait(10)
    after = _threads(me)[ident[0]]
    leave.set()
    t.join()
    assert 0.0025 <= after - before < 0.008, after - before
