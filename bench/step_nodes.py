"""The primitives in one decode step's graph, counted: on a GPU a small model's decode
step is the CPU launching its kernels, so the count is a deterministic CPU-side proxy
for its time (docs/benchmarks.md, "Gemma 4 on a lent H200").

Counts, by primitive, the graph each path hands `mx.async_eval` in a steady decode step
(the Nth after every row decodes), of:
- `mlxd`: the checkpoint's language model as mlx-lm's text class (worker/vision/language.py
  `shared_language_model`) in mlx-lm's BatchGenerator with mlxd's patches (imported as the
  worker imports them), prompts of different lengths (left padding);
- `vlm`: mlx-vlm's own `batch_generate` on the same checkpoint and prompts;
- `plain`: the mlx-lm text class on plain per-layer caches (equal-length rows).

By default the counted step is built as the CUDA backend builds it (`_cuda_like`: MLX's
fast ops one primitive each, attention falling back where CUDA's kernels refuse), which
the CPU cannot run: the CPU builds every fast op as its fallback graph (`--cpu` counts
that). `--build` makes the probe checkpoint first (`build`: the 2b's layers and heads,
narrow). On it, 8 rows: mlxd 1864 kernels (primitives less views), mlx-vlm 1864, plain
caches 1639; 1 row: mlxd 1815, mlx-vlm (plain caches at one row) 1639.

At the 4th step mlxd's 8 rows still hold the join of prompts prefilled together (2092:
concatenations and splits of the caches); from the 10th on, 1864, as above (about 3
minutes a count on a 2-core CPU, most of it the 56-layer model's load and prefill).

    python -m bench.step_nodes /tmp/g4probe --build [--rows 1 8] [--steps 10] [--detail]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

# Primitives that are views or metadata on a GPU (no kernel of their own, mostly).
VIEWS = {"Broadcast", "Reshape", "Transpose", "Slice", "ExpandDims", "Squeeze",
         "AsStrided", "Depends", "StopGradient", "Unflatten", "Flatten", "Split"}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def count(*outputs) -> collections.Counter:
    """Primitive name → nodes in the graph of `outputs` (not evaluated)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))


class Counted(Exception):
    """The step's graph is counted: what runs it stops there (its values are not)."""


# The CUDA backend's kernels for MLX's fast ops, one primitive each (the CPU builds their
# fallbacks, a dozen primitives each). Stand-ins of one primitive, named here, for the
# counted step only: their values are not the ops'.
STAND_INS = {"Erf": "RMSNorm", "ErfInv": "RoPE", "ArcTanh": "SDPA(vector kernel)"}
_REAL = {}


def _cuda_like(on: bool) -> None:
    """mx.fast's rms_norm, rope and sdpa as the CUDA backend (MLX 0.32) builds them: one
    primitive each, but attention falls back to its composite graph (as on the CPU)
    where mlx/backend/cuda/scaled_dot_product_attention.cu's `supports_sdpa_vector`
    refuses: an array mask, a head size other than 64, 96 or 128, 4 or more queries (cuDNN
    takes a decode step only with no array mask and an evaluated, 256-aligned cache:
    never while the graph is built)."""
    fast = mx.fast
    if not _REAL:
        _REAL.update(rms_norm=fast.rms_norm, rope=fast.rope,
                     sdpa=fast.scaled_dot_product_attention)
    if not on:
        fast.rms_norm, fast.rope = _REAL["rms_norm"], _REAL["rope"]
        fast.scaled_dot_product_attention = _REAL["sdpa"]
        return

    def rms_norm(x, weight, eps, **kw):
        return mx.erf(x)

    def rope(x, dims, *, offset, **kw):
        y = mx.erfinv(x)
        return mx.depends(y, [offset]) if isinstance(offset, mx.array) else y

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
        d = q.shape[-1]
        if (not isinstance(mask, mx.array) and d == v.shape[-1] and d in (64, 96, 128)
                and q.shape[2] < 4):
            return mx.depends(mx.arctanh(q), [k, v])
        return _REAL["sdpa"](q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)

    fast.rms_norm, fast.rope, fast.scaled_dot_product_attention = rms_norm, rope, sdpa


class Capture:
    """`mx.async_eval` hooked: the graph of the `at`-th call from a `_step` counted, then
    `Counted` raised. `cuda`: that step built with the CUDA backend's fast ops."""

    def __init__(self, at: int, cuda: bool = False):
        assert at >= 2
        self.at, self.seen, self.counts, self.cuda = at, 0, None, cuda
        self.original = mx.async_eval

    def __enter__(self):
        def hook(*args):
            if sys._getframe(1).f_code.co_name != "_step":
                return self.original(*args)
            self.seen += 1
            if self.seen == self.at:
                _cuda_like(False)
                flat = []
                for a in args:
                    flat.extend(a if isinstance(a, (list, tuple)) else [a])
                self.counts = count(*[a for a in flat if isinstance(a, mx.array)])
                raise Counted
            out = self.original(*args)
            if self.seen == self.at - 1 and self.cuda:
                _cuda_like(True)
            return out

        mx.async_eval = hook
        return self

    def __exit__(self, kind, *exc):
        mx.async_eval = self.original
        _cuda_like(False)
        return kind is Counted


def prompts(tokenizer, rows: int, equal: bool = False) -> list[list[int]]:
    """`rows` prompts of different lengths (equal: the same length)."""
    out = []
    for i in range(rows):
        n = 1 if equal else i + 1
        text = f"Tell me story number {i} about " + " ".join(WORDS[: n] * (1 + 2 * n))
        out.append(tokenizer.encode(text))
    if equal:
        short = min(map(len, out))
        out = [p[:short] for p in out]
    return out


def mlxd(path: Path, rows: int, steps: int, cuda: bool) -> collections.Counter:
    import worker.vision.batch  # noqa: F401  (mlxd's patches of mlx-lm, as the worker)
    from mlx_lm.generate import BatchGenerator, generation_stream
    from mlx_vlm import load

    from worker.text.sampling import _shared_sampler
    from worker.vision.language import shared_language_model

    vlm, processor = load(str(path))
    lm = shared_language_model(vlm, path)
    assert lm is not None
    tok = processor.tokenizer
    gen = BatchGenerator(lm, stop_tokens=[[tok.eos_token_id]], completion_batch_size=rows,
                         prefill_batch_size=rows, prefill_step_size=512,
                         stream=generation_stream)
    ids = prompts(tok, rows)
    sampler = _shared_sampler(0.0, 0.0, 0.0, 0)
    gen.insert(ids, max_tokens=[steps + 64] * rows, samplers=[sampler] * rows,
               logits_processors=[[] for _ in ids])
    with Capture(steps, cuda) as cap:
        while True:
            gen.next()
    return cap.counts


def vlm(path: Path, rows: int, steps: int, cuda: bool) -> collections.Counter:
    from mlx_vlm import load
    from mlx_vlm.generate import batch_generate

    model, processor = load(str(path))
    texts = [f"Tell me story number {i} about " + " ".join(WORDS[: i + 1] * (3 + 2 * i))
             for i in range(rows)]
    with Capture(steps, cuda) as cap:
        batch_generate(model, processor, prompts=texts, max_tokens=steps + 4)
    return cap.counts


def plain(path: Path, rows: int, steps: int, cuda: bool) -> collections.Counter:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm import load

    from worker.vision.language import shared_language_model

    vlm_model, processor = load(str(path))
    lm = shared_language_model(vlm_model, path)
    cache = make_prompt_cache(lm)
    ids = mx.array(prompts(processor.tokenizer, rows, equal=True))
    y = mx.argmax(lm(ids, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    for i in range(steps):
        if i == steps - 1:
            _cuda_like(cuda)
        logits = lm(y[:, None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.argmax(logprobs, axis=-1)
        if i == steps - 1:
            _cuda_like(False)
            return count(nxt, logprobs)
        mx.eval(nxt, logprobs)
        y = nxt


def build(path: Path) -> Path:
    """A Gemma 4 checkpoint with the 2b size's layers (56: 28 sliding, 28 global, the last
    28 reading shared KV), heads (12 of 128, the global ones 256) and window (512), but
    narrow (hidden 256, MLP 512) and a one-layer vision tower: the 2b's graph, cheap on
    a CPU (the count does not depend on widths). bf16, as on a GPU."""
    from worker.demos import vision

    vision.SIZES.setdefault("g4probe", dict(vision.SIZES["2b"], hidden=256, mlp=512,
                                            depth=1, embed=64, vision_heads=2))
    vision.build_vision_model(path, "g4probe", family="gemma4", dtype="bfloat16")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--build", action="store_true", help="build the probe checkpoint at PATH")
    ap.add_argument("--cpu", action="store_true",
                    help="count the CPU's graph (fast ops as their fallbacks)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=10,
                    help="count the Nth step (before about the 10th, mlxd's batch still "
                         "merges the prompts it prefilled together)")
    ap.add_argument("--which", nargs="+", default=["mlxd", "vlm", "plain"])
    ap.add_argument("--detail", action="store_true")
    args = ap.parse_args()
    if args.build:
        build(args.path)
    table = {}
    for which in args.which:
        for rows in args.rows:
            c = {"mlxd": mlxd, "vlm": vlm, "plain": plain}[which](args.path, rows, args.steps,
                                                                   not args.cpu)
            table[which, rows] = c
            c = collections.Counter({STAND_INS.get(k, k): v for k, v in c.items()})
            table[which, rows] = c
            views = sum(v for k, v in c.items() if k in VIEWS)
            total = sum(c.values())
            print(f"{which:6s} rows={rows}: {total} primitives, {total - views} not views",
                  flush=True)
    names = sorted({k for c in table.values() for k in c})
    if args.detail:
        cols = list(table)
        print("primitive".ljust(28) + "".join(f"{w}@{r}".rjust(11) for w, r in cols))
        for n in names:
            print(n.ljust(28) + "".join(str(table[c][n]).rjust(11) for c in cols))


if __name__ == "__main__":
    main()
