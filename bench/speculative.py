"""Speculative decoding (worker/speculative/) against none, in mlxd's batch in this
process, on the real `demo` model (SmolLM2-135M-Instruct), temperature 0, texts compared:

(a) an agent edit: a 40-line source file in the prompt, "return it with this one change"
    (prompt lookup; Predicted Outputs with the original file as the prediction);
(b) open prose (prompt lookup: adaptive drafting must cost nothing where it finds little).

One stream and 8 streams (the same request 8 times, no prefix cache), completion tokens
per second over the whole run (prefill included, the same in every variant), the best of
`--rounds` rounds alternating variants, and each variant's acceptance.

    python -m bench.speculative [--tokens 200] [--rounds 2] [--streams 1,8]
                                [--cases edit,prediction,prose] [--step-cost]

`--step-cost` first times the forward pass that verifies a draft of d tokens (1 + d
positions, one sequence, a 200-token context) against the one-token step: the tokens
a draft must earn to pay (worker/speculative/adaptive.py's MIN_GAIN).
"""

from __future__ import annotations

import argparse
import time

from bench.make_model import model_path

SOURCE = "\n".join(
    [f"def step_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n"
     f"        total += v * scale\n    return total  # step {i}\n" for i in range(8)])
EDIT = [{"role": "user", "content": "Here is a Python file:\n\n" + SOURCE + "\n\nReturn the "
         "whole file with one change: rename the function step_3 to scaled_sum. Output only "
         "the code."}]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
          "finds a message in a bottle."}]


def run(eng, batch, messages, streams: int, tokens: int, prediction: str | None):
    from protocol import Generate, SamplingParams

    class Seq:
        def __init__(self, rid):
            self.rid, self.uid = rid, None

    texts = {f"s{i}": [] for i in range(streams)}
    start = time.perf_counter()
    for rid in texts:
        gen = Generate(rid=rid, messages=messages, prediction=prediction,
                       sampling=SamplingParams(max_tokens=tokens, temperature=0.0))
        batch.add(Seq(rid), eng.prepare(gen))
    n = 0
    while batch.members:
        for seq, out in batch.step():
            texts[seq.rid].append(out[1])
            n += out[0] >= 0
    return n / (time.perf_counter() - start), ["".join(t) for t in texts.values()]


def step_cost(eng, drafts=(1, 2, 4, 8), reps: int = 20) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(eng.model)
    mx.eval(eng.model(mx.array([list(range(1, 201))]), cache=cache))

    def once(width: int) -> float:
        t = time.perf_counter()
        mx.eval(eng.model(mx.array([[7] * width]), cache=cache))
        dt = time.perf_counter() - t
        for c in cache:
            c.trim(width)
        return dt

    times = {w: [] for w in (1,) + tuple(1 + d for d in drafts)}
    for _ in range(reps):  # (interleaved, the best of each: the machine drifts)
        for w in times:
            times[w].append(once(w))
    one = min(times[1])
    print(f"one-token step {one * 1e3:.1f} ms; verifying a draft of d tokens costs "
          "(x the one-token step), i.e. accepted tokens it must earn:")
    for d in drafts:
        cost = min(times[1 + d]) / one
        print(f"  d={d}: {cost:.2f}x, {cost - 1:.2f} tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--cases", default="edit,prediction,prose")
    p.add_argument("--step-cost", action="store_true")
    a = p.parse_args()
    from bench.gpu import in_process
    path = model_path("smollm2", None)
    eng, _ = in_process(path, prompt_cache=0)
    if a.step_cost:
        step_cost(eng)

    def batch_for(spec: str):
        _, b = in_process(path, prompt_cache=0)
        b.prompt_lookup = spec == "prompt-lookup"
        return b

    cases = {"edit": ("edit", EDIT, "prompt-lookup", None),
             "prediction": ("edit", EDIT, "none", SOURCE),
             "prose": ("prose", PROSE, "prompt-lookup", None)}
    cases = [cases[c] for c in a.cases.split(",")]
    print(f"{'workload':8} {'drafter':18} {'streams':>7} {'none tok/s':>10} "
          f"{'spec tok/s':>10} {'ratio':>6} {'accept':>7} {'tok/verify':>10} same")
    for streams in [int(s) for s in a.streams.split(",")]:
        for work, messages, spec, prediction in cases:
            best = {"none": 0.0, "spec": 0.0}
            texts = {}
            stats = None
            for _ in range(a.rounds):
                b = batch_for("none")
                rate, texts["none"] = run(eng, b, messages, streams, a.tokens, None)
                best["none"] = max(best["none"], rate)
                b = batch_for(spec)
                rate, texts["spec"] = run(eng, b, messages, streams, a.tokens, prediction)
                best["spec"] = max(best["spec"], rate)
                stats = b.speculation.totals
            drafter = "prediction" if prediction else spec
            accept = stats.accepted / stats.drafted if stats.drafted else 0.0
            per = (stats.accepted + stats.verifications) / stats.verifications \
                if stats.verifications else 1.0
            print(f"{work:8} {drafter:18} {streams:7d} {best['none']:10.1f} "
                  f"{best['spec']:10.1f} {best['spec'] / best['none']:6.2f} {accept:7.2f} "
                  f"{per:10.2f} {texts['none'] == texts['spec']}", flush=True)


if __name__ == "__main__":
    main()
