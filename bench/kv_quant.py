"""A quantized KV cache (--kv-bits: worker/kvcache/quantized.py) against full precision,
in one run, in-process on mlxd's engine path (mlx-lm's BatchGenerator with mlxd's patches
and the batch cache of each format).

    python -m bench.kv_quant                      # the real `demo` model (SmolLM2-135M)
    python -m bench.kv_quant --shape 7b           # a random bf16 Qwen2.5-7B shape (a GPU)

For full precision, 8 and 4 bits (groups of --group-size):
- KV bytes per token (what the batch measures: worker/loop/batch.py KVSize) and the
  ratio to full precision;
- the longest context whose KV fits a 1 GiB --kv-budget;
- perplexity of a fixed English text, prefilled in chunks through the cache, so every
  chunk attends to the earlier ones' stored keys (the text: bench/texts/, Genesis 1-4 of
  the King James Version, public domain, from Debian's bible-kjv-text 4.38 via its
  `bible` reader: see bench/texts/README.md);
- greedy-token agreement with full precision: --prompts prompts (passages of the text) of
  --tokens generated tokens each, batched: the share of positions with the same token,
  and the mean first position where they differ;
- aggregate decode tokens/s at 1 and 8 streams (prompts of --speed-prompt tokens), and
  the ratio to full precision.
`--served` adds the perplexity read through a server of each format a worker runs (full,
8, 4r), by a legacy completion's `echo` with `logprobs` (what an evaluation harness sends).
--formats chooses what is measured: full, 8 and 4 (groups of --group-size), 4g32 (4 bits in
groups of 32), an `r` after any of these for keys and values stored rotated (4r, 4g32r:
what `--kv-bits 4` stores, worker/kvcache/quantized.py KVFormat.rotate), and mlx-vlm's
TurboQuant (`tq4`: 4-bit keys and values, `tq5v4`: 5-bit keys, 4-bit values; rotated
vectors, a Lloyd-Max codebook and one norm per vector). TurboQuant is not a format mlxd's
batch runs: its attention is mlx-vlm's, put in the model's module for this run, so it gets
bytes and perplexity only.
A random-weight shape (--shape) has no meaningful text: bytes, context and speed only.
Each quantized format's attention is chosen as a worker's load chooses it (worker/kvcache/
attention.py): mlx-lm's quantized_matmul, or where the device has no kernel for it (MLX's
CUDA backend), the dequantizing fallback; an "attention" row says which.
Goals (issue "a quantized KV cache"): 8 bits <= 0.55 x the bytes, perplexity within 1 %,
>= 0.9 x the speed; 4 bits <= 0.3 x the bytes, perplexity within 5 %.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from bench.report import goal, print_table
from supervisor.workers import blas

TEXT = Path(__file__).resolve().parent / "texts" / "genesis-1-4-kjv.txt"
GIB = 1 << 30


def load(args):
    """(model, token ids of the text or None, description)."""
    import mlx.core as mx

    if args.shape == "gemma3-4b":
        from mlx_lm.models import gemma3_text

        # Gemma 3 4B's attention (34 layers, a 1,024-token window in five layers of six, 4
        # KV heads of 256) around tiny MLPs and vocabulary: its KV, not its weights.
        config = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 64,
                  "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 256,
                  "sliding_window": 1024, "sliding_window_pattern": 6}
        mx.random.seed(0)
        model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        return model, None, "Gemma 3 4B's KV layout"
    if args.shape:
        from mlx_lm.models import qwen2

        from bench.gpu import SHAPES

        config = {"model_type": "qwen2", **SHAPES[args.shape], "rms_norm_eps": 1e-6,
                  "rope_theta": 1e6, "max_position_embeddings": 32768}
        mx.random.seed(0)
        model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
        model.set_dtype(mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32)
        mx.eval(model.parameters())
        return model, None, f"random {args.shape} shape"
    from mlx_lm import load as mlx_load

    from bench.make_model import model_path

    path = model_path("smollm2", args.model)
    model, tokenizer = mlx_load(str(path))
    ids = tokenizer.encode(args.text.read_text())
    return model, ids, f"{path.name if args.model else 'demo (SmolLM2-135M-Instruct)'}"


class TurboQuant:
    """mlx-vlm's TurboQuant KV cache for an mlx-lm model, as a format bench rows can measure
    (`make` a sequence's cache; `tokens_within` from its bytes after 256 tokens, its
    allocation step)."""
    quantized = True

    def __init__(self, key_bits: float, value_bits: float):
        self.key_bits, self.value_bits = key_bits, value_bits

    def make(self, model, max_kv_size=None) -> list:
        import sys

        import mlx_vlm.models.base as vlm_base
        from mlx_lm.models.cache import KVCache, make_prompt_cache
        from mlx_vlm.turboquant import TurboQuantKVCache

        # (mlx-vlm's attention: TurboQuant's own kernels, else mlx-lm's two paths.)
        sys.modules[type(model).__module__].scaled_dot_product_attention = \
            vlm_base.scaled_dot_product_attention
        bits = (self.key_bits + self.value_bits) / 2
        return [TurboQuantKVCache(bits, key_bits=self.key_bits, value_bits=self.value_bits)
                if type(c) is KVCache else c for c in make_prompt_cache(model, max_kv_size)]

    def check(self, model) -> None:
        pass

    def size(self, model):
        import mlx.core as mx

        from worker.loop.sizing import KVSize

        cache = self.make(model)
        model(mx.zeros((1, 256), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
        return KVSize(sum(c.nbytes for c in cache) / 256, 0, None)


def formats_of(spec: str, group_size: int) -> dict:
    """--formats: {row name: format}."""
    import re

    from worker.kvcache.quantized import KVFormat

    out = {}
    for word in spec.split(","):
        word = word.strip()
        if word == "full":
            out["full"] = KVFormat()
        elif m := re.fullmatch(r"(4|8)(?:g(\d+))?(r?)", word):
            g = int(m[2] or group_size)
            out[f"{m[1]}-bit" + (f" g{g}" if m[2] else "") + (" rotated" if m[3] else "")] = \
                KVFormat(int(m[1]), g, rotate=bool(m[3]))
        elif m := re.fullmatch(r"tq(\d)(?:v(\d))?", word):
            k, v = int(m[1]), int(m[2] or m[1])
            out[f"TurboQuant k{k}v{v}"] = TurboQuant(k, v)
        else:
            raise SystemExit(f"--formats: not full, 8, 4, 4g32, 4r, 4g32r or tq4/tq5v4: "
                             f"{word!r}")
    return out


def perplexity(model, fmt, ids: list[int], chunk: int) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    cache = fmt.make(model)
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        x = ids[start: start + chunk + 1]
        logits = model(mx.array(x[:-1])[None], cache=cache)
        loss = nn.losses.cross_entropy(logits[0].astype(mx.float32), mx.array(x[1:]),
                                       reduction="sum")
        mx.eval(loss, [c.state for c in cache])
        nll += loss.item()
        n += len(x) - 1
    return math.exp(nll / n)


# The formats a worker runs, by their server flags (`--kv-bits 4` stores keys rotated).
SERVED = {"full": [], "8-bit": ["--kv-bits", "8"], "4-bit rotated": ["--kv-bits", "4"]}


def served_perplexity(model: str, flags: list[str], group_size: int, ids: list[int]) -> float:
    """Perplexity of `ids` through a server of `model` with `flags`: a legacy completion
    with `echo`, `logprobs` and no new tokens returns each prompt token's logprob, scored
    over the worker's own KV format (worker/loop/echo.py), as lm-evaluation-harness's
    loglikelihood_rolling reads a text through an API."""
    import json

    from bench.serverproc import ServerProcess
    from bench.throughput import request

    body = {"model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    with ServerProcess([model], *flags, "--kv-group-size", str(group_size)) as srv:
        srv.wait_healthy(600)
        conn, resp = request(srv.port, "/v1/completions", body)
        try:
            got = json.loads(resp.read())
        finally:
            conn.close()
    rows = got["choices"][0]["logprobs"]["token_logprobs"][1:]  # (the first: no context)
    return math.exp(-sum(rows) / len(rows))


def generate(model, fmt, prompts: list[list[int]], tokens: int) -> tuple[list, float]:
    """Greedy tokens of each prompt, batched; and the aggregate decode tokens/s (from the
    step every prompt has its first token)."""
    from mlx_lm.generate import BatchGenerator, generation_stream

    import worker.loop.batch  # noqa: F401  (mlxd's patches of mlx-lm's batch)

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts), prefill_step_size=2048,
                         stream=generation_stream)
    uids = gen.insert_segments(segments=[[p] for p in prompts],
                               max_tokens=[tokens] * len(prompts),
                               caches=[fmt.make(model) for _ in prompts])
    out = {u: [] for u in uids}
    t0, counted, done = None, 0, set()
    while len(done) < len(uids):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
        if t0 is None and all(out.values()):
            t0, counted = time.perf_counter(), sum(map(len, out.values()))
    speed = (sum(map(len, out.values())) - counted) / (time.perf_counter() - t0)
    gen.close()
    return [out[u] for u in uids], speed


def agreement(ref: list, other: list) -> tuple[float, float]:
    """(share of positions with the same token, mean first differing position)."""
    same = total = 0
    firsts = []
    for a, b in zip(ref, other):
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    return same / total, sum(firsts) / len(firsts)


def goal_of(name: str, eight: float, four: float):
    """The issue's goal for a format's row: 8 bits', or 4 bits' (TurboQuant's too)."""
    if name.startswith("8-bit"):
        return eight
    return four if name != "full" else None


class Rows(list):
    """The table's rows, each also said on stderr as it comes (a run cut short keeps
    what it measured)."""

    def append(self, row) -> None:
        progress("  ".join(map(str, row)))
        super().append(row)


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: demo, SmolLM2-135M)")
    p.add_argument("--shape", choices=("0.5b", "7b", "gemma3-4b"),
                   help="a random bf16 Qwen2.5 shape instead: bytes and speed only; "
                   "gemma3-4b: Gemma 3 4B's attention layout (sliding windows), bytes only")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--formats", default="full,8,4r,4,4g32r",
                   help="what to measure (the first is the reference): full, 8, 4, 4g32, "
                   "4r, 4g32r, tq4, tq5v4 (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=512, help="perplexity's prefill chunk")
    p.add_argument("--text-tokens", type=int, default=None,
                   help="perplexity over the text's first this many tokens (default: all)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=512, help="generated per agreement prompt")
    p.add_argument("--speed-prompt", type=int, default=512)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--streams", default="1,8", help="decode speed at these stream counts")
    p.add_argument("--served", action="store_true",
                   help="also perplexity through a server of each format a worker runs "
                   "(full, 8, 4r: --kv-bits 4), as an evaluation harness reads it: echo")
    args = p.parse_args()

    import mlx.core as mx

    from worker.kvcache import attention
    from worker.kvcache.quantized import KVFormat
    from worker.loop.sizing import KVSize

    model, ids, what = load(args)
    if ids is not None and args.text_tokens:
        ids = ids[: args.text_tokens]
    formats = formats_of(args.formats, args.group_size)
    batched = {n: f for n, f in formats.items() if isinstance(f, KVFormat)}
    rows, base = Rows(), {}
    for name, fmt in formats.items():
        fmt.check(model)  # (a quantized KVFormat: which attention reads it, as a worker's load)
        if isinstance(fmt, KVFormat) and fmt.quantized:
            rows.append((f"{name}: attention", "dequantized (no quantized_matmul kernel)"
                         if attention.dequantizes(fmt.bits, fmt.group_size)
                         else "quantized_matmul", ""))
    # (256 tokens: MLX 0.32.4's CUDA quantized_matmul has no kernel for a few keys.)
    for name, fmt in formats.items():
        kv = KVSize.measure(model, None, fmt, tokens=256) if isinstance(fmt, KVFormat) \
            else fmt.size(model)
        base.setdefault("bytes", kv.per_token)
        ratio = kv.per_token / base["bytes"]
        target = goal_of(name, 0.55, 0.3)
        rows.append((f"{name}: KV bytes per token", f"{kv.per_token:,.0f} ({ratio:.3f} x)",
                     goal(ratio, "<=", target) if target else ""))
        rows.append((f"{name}: longest context in a 1 GiB budget",
                     f"{kv.tokens_within(GIB):,} tokens", ""))
        if getattr(kv, "windows", ()):  # (sliding layers: counted once, up to the window)
            every = KVSize(kv.per_token + sum(per for per, _ in kv.windows), kv.per_sequence)
            rows.append((f"{name}:   every layer counted per token (before)",
                         f"{every.per_token:,.0f} bytes, {every.tokens_within(GIB):,} tokens",
                         ""))
    if args.shape == "gemma3-4b":
        print_table(f"bench.kv_quant: {what}, groups of {args.group_size}", rows)
        return
    if ids is not None:
        for name, fmt in formats.items():
            progress(f"perplexity, {name}")
            ppl = perplexity(model, fmt, ids, args.chunk)
            base.setdefault("ppl", ppl)
            rel = ppl / base["ppl"] - 1
            target = goal_of(name, 0.01, 0.05)
            rows.append((f"{name}: perplexity ({len(ids):,} tokens)",
                         f"{ppl:.3f} ({rel:+.2%})", goal(rel, "<=", target) if target else ""))
        if args.served:
            for name, flags in SERVED.items():
                if name in formats:
                    progress(f"perplexity served, {name}")
                    ppl = served_perplexity(args.model or "demo", flags, args.group_size, ids)
                    rel = ppl / base["ppl"] - 1
                    rows.append((f"{name}: perplexity served ({len(ids):,} tokens, echo)",
                                 f"{ppl:.3f} ({rel:+.2%} of in-process {next(iter(formats))})",
                                 ""))
        span = max(1, (len(ids) - 64) // args.prompts)
        prompts = [ids[i * span: i * span + 64] for i in range(args.prompts)]
        ref = None
        for name, fmt in batched.items():
            progress(f"agreement, {name}")
            out, _ = generate(model, fmt, prompts, args.tokens)
            if ref is None:
                ref = out
                continue
            share, first = agreement(ref, out)
            rows.append((f"{name}: greedy agreement ({args.prompts} x {args.tokens} tokens)",
                         f"{share:.1%} of tokens, first difference at {first:.0f} (mean)",
                         ""))
    vocab = model.args.vocab_size
    for streams in map(int, args.streams.split(",")):
        prompts = [[(7 + 31 * (s * args.speed_prompt + i)) % vocab
                    for i in range(args.speed_prompt)] for s in range(streams)]
        for name, fmt in batched.items():
            progress(f"speed, {streams} stream(s), {name}")
            try:
                generate(model, fmt, [q[:64] for q in prompts], 4)  # (compiles kernels)
                _, speed = generate(model, fmt, prompts, args.speed_tokens)
            except RuntimeError as e:  # (a kernel MLX lacks for a shape the check missed)
                rows.append((f"{name}: decode tok/s, {streams} stream(s)", "failed",
                             str(e).splitlines()[0][:110]))
                continue
            base.setdefault(streams, speed)
            ratio = speed / base[streams]
            rows.append((f"{name}: decode tok/s, {streams} stream(s), {args.speed_prompt}-token "
                         "prompts", f"{speed:,.1f} ({ratio:.2f} x)",
                         goal(ratio, ">=", 0.9) if name.startswith("8-bit") else ""))
    device = mx.device_info().get("device_name", str(mx.default_device()))
    print_table(f"bench.kv_quant: {what} on {device}, groups of {args.group_size}", rows)


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
