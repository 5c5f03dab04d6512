"""A burst of image chats through the worker's own batch, in-process: its image prompts
prefilled as one batch (worker/vision/group.py) against one by one, side by side.

    python -m bench.vision_group [--size tiny] [--family gemma4] [--streams 8]
                                 [--tokens 64] [--rounds 6]

The batch is the one worker/__main__.py loads for the checkpoint (`KINDS[kind].start`);
each round adds `--streams` new chats, each with its own image of one size after words of
different lengths, and steps the batch until all have ended: with the group prefill;
with it but each prompt's images through the vision tower on their own (the shared
tower call of worker/vision/towers.py off); and with it off (`VisionBatch._together`
answering none); each first in turn. It prints each round's time to the first token,
the wall time, and their medians' ratios. No HTTP:
what the group saves is the image prefill's forward passes (two for the burst where
each prompt's state before its image is kept, against two a prompt).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from bench.make_model import MODELS_DIR
from bench.vision_throughput import image_png


def burst(engine, batch, n: int, tokens: int, first: int) -> tuple[float, float]:
    """(s to the first token, s to the last) of `n` image chats added at once."""
    from bench.inprocess import Seq
    from protocol import Generate, SamplingParams

    t0, first_token = time.perf_counter(), None
    for i in range(first, first + n):
        gen = Generate(rid=f"r{i}", messages=[{"role": "user", "content": [
            {"type": "text", "text": f"Tell me story number {i} about" + " it" * (i % 4)},
            {"type": "image"}]}], images=(image_png(64, i),),  # (as the supervisor sends)
            sampling=SamplingParams(temperature=0.0, max_tokens=tokens))
        batch.add(Seq(gen.rid), engine.prepare(gen))
    while len(batch):
        if batch.step() and first_token is None:
            first_token = time.perf_counter() - t0
    return first_token, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--family", default="gemma4")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    from protocol.settings import worker_parser
    from worker.demos.vision import build_vision_model
    from worker.loading import models
    from worker.loading.kinds import KINDS
    from worker.vision import towers
    from worker.vision.batch import VisionBatch

    path = build_vision_model(MODELS_DIR / f"{a.size}-vision-{a.family}-float32", a.size,
                              family=a.family).path
    together, families = VisionBatch._together, towers.FAMILIES
    sides = ("together", "together, a tower call a prompt", "one by one")
    seen = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as state:
        args = worker_parser().parse_args([
            "--model", str(path), "--commands", "x", "--events", "y", "--epoch", "1",
            "--state-dir", state, "--max-batch-size", str(a.streams)])
        loaded = models.load(args.model, args.state_dir, args.max_context_tokens)
        engine, batch = KINDS[loaded.kind].start(loaded, args)
        for r in range(a.rounds + 1):  # (the first round of each: MLX's first shapes)
            for k in range(len(sides)):  # (each side first in turn)
                side = sides[(r + k) % len(sides)]
                VisionBatch._together = together if side != "one by one" else (lambda *_: 0)
                towers.FAMILIES = families if side == "together" else {}
                ttft, wall = burst(engine, batch, a.streams, a.tokens,
                                   1000 * r + 100 * sides.index(side))
                if r:
                    seen[side].append((ttft, wall))
                    print(f"  round {r} {side:31}  first token {ttft * 1e3:6.1f} ms, "
                          f"all {wall * 1e3:6.1f} ms")
        batch.close()
    VisionBatch._together, towers.FAMILIES = together, families
    med = {s: [statistics.median(x[i] for x in v) for i in (0, 1)] for s, v in seen.items()}
    print(f"\n{a.size}-vision-{a.family}, {a.streams} image chats of {a.tokens} tokens, "
          f"{a.rounds} rounds (medians):")
    for s, (ttft, wall) in med.items():
        print(f"  {s:31}  first token {ttft * 1e3:6.1f} ms, all {wall * 1e3:6.1f} ms")
    for s in sides[:2]:
        print(f"  {s} / one by one: first token {med[s][0] / med['one by one'][0]:.2f}"
              f", all {med[s][1] / med['one by one'][1]:.2f}")


if __name__ == "__main__":
    main()
