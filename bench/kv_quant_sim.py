"""Candidate 4-bit KV schemes, simulated: keys and values quantized and dequantized as they
enter a plain cache (mlx-lm's KVCache), so a scheme mlxd's quantized cache does not store
yet (other group sizes or bits for keys than values, the first tokens of a sequence kept
at full precision, some layers kept at full precision) can be measured for perplexity
before it is built. The cache's arithmetic is the stored format's up to rounding (the
real cache multiplies the packed integers); bytes are not measured here: count them from
the scheme (affine groups: bits + 2 x 16 / group size bits per element in half precision).

    python -m bench.kv_quant_sim --model bench/models/smollm2 \
        --schemes "k4g64r v4g64r; k4g64r v4g64r full=0,1; k4g32r v4g64r sink=4"

A scheme is words: k<bits>g<group>[r] and v<bits>g<group>[r] (r: rotated as --kv-bits 4
stores, worker/kvcache/attention.py), sink=N (a sequence's first N tokens at full
precision), full=I,J (those layers at full precision). Perplexity as bench.kv_quant's
(prefilled in chunks through the cache), over the first 512 and 1,024 tokens of the text
from --offset (the same pass: its first two chunks of 256 are the 512-token figure).
"""

from __future__ import annotations

import argparse
import math
import re

from bench.kv_quant import TEXT
from supervisor.workers import blas


def scheme_of(spec: str) -> dict:
    out = {"k": None, "v": None, "sink": 0, "full": set()}
    for word in spec.split():
        if m := re.fullmatch(r"([kv])(\d)g(\d+)(r?)", word):
            out[m[1]] = (int(m[2]), int(m[3]), bool(m[4]))
        elif m := re.fullmatch(r"sink=(\d+)", word):
            out["sink"] = int(m[1])
        elif m := re.fullmatch(r"full=([\d,]+)", word):
            out["full"] = {int(i) for i in m[1].split(",")}
        else:
            raise SystemExit(f"--schemes: not k4g64r, v4g64, sink=N or full=I,J: {word!r}")
    return out


def simulated_cache(scheme: dict):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from worker.kvcache.attention import rotate, unrotate

    def lossy(x, how, start):
        if how is None:
            return x
        bits, group, rotated = how
        y = rotate(x) if rotated else x
        y = mx.dequantize(*mx.quantize(y, group_size=group, bits=bits), group_size=group,
                          bits=bits).astype(x.dtype)
        y = unrotate(y) if rotated else y
        kept = min(max(scheme["sink"] - start, 0), x.shape[2])
        return mx.concatenate([x[:, :, :kept], y[:, :, kept:]], axis=2) if kept else y

    class Simulated(KVCache):
        def update_and_fetch(self, keys, values):
            start = self.offset
            return super().update_and_fetch(lossy(keys, scheme["k"], start),
                                            lossy(values, scheme["v"], start))
    return Simulated


def perplexities(model, make, ids, chunk=256) -> list[float]:
    import mlx.core as mx
    import mlx.nn as nn

    cache = [make(i) for i in range(len(model.layers))]
    nll = []
    for start in range(0, len(ids) - 1, chunk):
        x = ids[start: start + chunk + 1]
        logits = model(mx.array(x[:-1])[None], cache=cache)
        loss = nn.losses.cross_entropy(logits[0].astype(mx.float32), mx.array(x[1:]),
                                       reduction="sum")
        mx.eval(loss)
        nll.append((loss.item(), len(x) - 1))
    return [math.exp(sum(a for a, _ in nll[:k]) / sum(n for _, n in nll[:k]))
            for k in (512 // chunk, 1024 // chunk)]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_quant_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: demo, SmolLM2-135M)")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--offset", type=int, default=0, help="the text's first token measured")
    p.add_argument("--schemes", required=True, help="schemes separated by ';'")
    args = p.parse_args()

    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import KVCache

    from bench.make_model import model_path

    model, tokenizer = mlx_load(str(model_path("smollm2", args.model)))
    ids = tokenizer.encode(open(args.text).read())[args.offset: args.offset + 1025]
    base = perplexities(model, lambda i: KVCache(), ids)
    print(f"full: perplexity {base[0]:.3f} (512 tokens), {base[1]:.3f} (1,024)", flush=True)
    for spec in args.schemes.split(";"):
        scheme = scheme_of(spec)
        cls = simulated_cache(scheme)
        ppl = perplexities(model, lambda i: KVCache() if i in scheme["full"] else cls(), ids)
        print(f"{spec.strip()}: " + ", ".join(f"{q / b - 1:+.2%} ({n})" for q, b, n in
                                              zip(ppl, base, ("512", "1,024"))), flush=True)


if __name__ == "__main__":
    blas.reexec()
    main()
