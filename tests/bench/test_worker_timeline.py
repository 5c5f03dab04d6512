"""bench/worker_timeline.py: a real server's worker traced while a wave of chats runs,
its lines merged with the client's on one clock."""

from __future__ import annotations

from bench import worker_timeline
from bench.timeline import sitecustomize


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


def test_the_step_summary_counts_the_full_decode_steps_apart_from_the_rest():
    events = [(0.0, "step 10.00 waiting/prefilling/decoding 0 0 8 out 8"),
              (0.1, "step 30.00 waiting/prefilling/decoding 0 0 8 out 8"),
              (0.2, "step 20.00 waiting/prefilling/decoding 0 0 8 out 8"),
              (0.3, "step 250.00 waiting/prefilling/decoding 2 6 0 out 0"),
              (0.4, "step 5.00 waiting/prefilling/decoding 0 0 7 out 7"),
              (0.5, "admit r1 22 0.5")]
    line = worker_timeline.step_summary(events, 8)
    assert line.startswith("3 decode steps of 8: median 20.00 ms, p90 20.00")
    assert "2 other steps: 255 ms in all, longest 250" in line
    assert worker_timeline.step_summary(events[3:], 8).startswith("no full decode steps; 2")


def test_the_checkpoint_served_as_a_text_model_is_traced_too():
    (wave,) = worker_timeline.run("tiny", "gemma4", waves=1, streams=2, tokens=4,
                                  as_text=True)
    assert wave["model"].endswith("-as-text")  # (bench.vision_throughput's text copy)
    assert wave["admitted"] == 2 and "waiting/prefilling/decoding" in "\n".join(wave["lines"])


def test_phases_time_what_a_step_did_between_synchronizations():
    (wave,) = worker_timeline.run("tiny", "gemma4", waves=1, streams=2, tokens=4,
                                  phases=True)
    phases = [line.split()[3:5] for line in wave["lines"] if " phase " in line]
    names = {name for name, _ in phases}
    # Two chats: each put into the batch, its prompt's last token and first token's pass
    # (which steps come after depends on when each ends: one CI run saw no decode step).
    assert {"Batch.insert", "PromptProcessingBatch.generate"} <= names, names
    assert names <= {f"{cls}.{name}" for _, cls, name in sitecustomize.PHASES}, names
    assert all(float(ms) >= 0 for _, ms in phases)
