"""Constrained decoding cost: json_schema decode speed ÷ unconstrained, and grammar build
time for a 20-tool request, in-process on the engine (no HTTP: this measures the engine).

    python -m bench.constrained [--preset small|tiny] [--model PATH] [--tokens N] [--rounds R]

Prints:
- decode tokens/s with a json_schema constraint ÷ without (goal ≥ 0.9 on `small`). The
  schema asks for an array of more strings than a run can write, so the constraint is
  live for the whole run (every token is masked; none ends it early);
- time to build the grammar (llguidance matcher) for a tool_choice "required" request
  with 20 tools, median of the rounds (the llguidance tokenizer is built once, before):
  cold (a grammar not seen before) and cached (the same request again).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import msgspec

from bench.inprocess import Seq
from bench.make_model import MODELS_DIR
from bench.report import goal, print_table

# More items than any run writes: the constraint is live on every token of every run.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                     "minItems": 100_000}},
          "required": ["notes"]}
GOAL = 0.9


def tools(n: int, tag: str = "") -> list:
    return [{"type": "function", "function": {
        "name": f"tool{tag}_{i}", "description": f"Tool number {i}.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1,
                                                    "maximum": 100},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "filters": {"type": "array", "items": {"type": "string"}}},
            "required": ["query"]}}} for i in range(n)]


def decode_rate(batch, gen) -> tuple[float, int]:
    """One request alone through the worker's batch: tokens/s between the first and last."""
    batch.add(Seq(gen.rid), batch.engine.prepare(gen))
    first = last = None
    n = 0
    while batch.members:
        for _, out in batch.step():
            now = time.perf_counter()
            first = first or now
            last = now
            n += out[0] >= 0
    return (n - 1) / (last - first), n


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.constrained", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--model", help="a local model directory instead of a preset")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from protocol.messages import Generate, OutputSpec, SamplingParams
    from worker.loading import models
    from worker.demos.text import QWEN, build_model
    from worker.loop.batch import Batch
    from worker.loop.sizing import KVSize
    from worker.text.engine import TextEngine

    path = Path(args.model) if args.model else build_model(
        MODELS_DIR / f"{args.preset}-qwen", args.preset, template=QWEN).path
    loaded = models.load(str(path), path.parent)
    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 512,
                        loaded.vocab_size)
    batch = Batch(engine, max_size=1, prefill_step=512, prefill_batch=1, kv_budget=1 << 34,
                  kvcache=None, kv=KVSize.measure(loaded.model))
    batch.warm()
    plain = Generate(rid="b", messages=[{"role": "user", "content": "Write notes."}],
                     sampling=SamplingParams(max_tokens=args.tokens, temperature=0.0),
                     template_kwargs={"enable_thinking": False})
    constrained = msgspec.structs.replace(plain, output=OutputSpec(
        response_format="json_schema", json_schema=SCHEMA))
    decode_rate(batch, plain)
    decode_rate(batch, constrained)  # warm-up; also builds the llguidance tokenizer
    p_rates, c_rates = [], []
    for _ in range(args.rounds):  # alternate, so drift on a noisy machine hits both
        p_rates.append(decode_rate(batch, plain)[0])
        rate, n_c = decode_rate(batch, constrained)
        c_rates.append(rate)
    ratio = statistics.median(c_rates) / statistics.median(p_rates)

    # Cold: a grammar never seen (other tool names each round); cached: the same again
    # (the worker caches compiled grammars by their text).
    builds, cached = [], []
    for r in range(args.rounds):
        twenty = OutputSpec(tools=tools(20, f"r{r}"), tool_choice="required")
        for times in (builds, cached):
            t0 = time.perf_counter()
            engine.grammars.constraint(twenty)
            times.append((time.perf_counter() - t0) * 1000)

    rows = [
        ("model", f"{args.model or args.preset} ({path})", ""),
        ("tokens per run / rounds", f"{args.tokens} / {args.rounds} (constrained made {n_c})", ""),
        ("unconstrained decode tok/s (median)", f"{statistics.median(p_rates):.1f}", ""),
        ("json_schema decode tok/s (median)", f"{statistics.median(c_rates):.1f}", ""),
        ("constrained / unconstrained", f"{ratio:.3f}",
         goal(ratio, ">=", GOAL)),
        ("grammar build, 20 tools, cold (median ms)", f"{statistics.median(builds):.1f}", ""),
        ("grammar build, 20 tools, cached (median ms)", f"{statistics.median(cached):.2f}", ""),
    ]
    print_table(f"python -m bench.constrained --preset {args.preset}", rows)


if __name__ == "__main__":
    main()
