"""Throughput and prompt reuse of a vision-language checkpoint: mlxd against raw mlx-vlm and
mlx-vlm's own server, in one run (the vision presets of bench/throughput.py).

    python -m bench.vision_throughput [--size tiny|small] [--family qwen2-vl|qwen3.5|gemma3]
                                      [--quick] [--no-peer]

The model: a random-weight vision checkpoint built locally (worker/demos/vision.py:
`small` is hidden 512, 8 language layers, a 4-layer vision tower, images of up to
448×448 = 256 image tokens; `qwen3.5` its hybrid linear-attention family, `gemma3`
Gemma 3's, a sliding window every other layer). At
temperature 0, side by side:
- aggregate decode tokens/s at 1, 4 and 8 concurrent streams, text-only and with one
  image each (a different image per stream): raw mlx-vlm `batch_generate` in-process,
  mlxd over HTTP, and `mlx_vlm.server` (started here);
- text-only requests on the vision checkpoint ÷ the same language model served as a
  text model (the checkpoint's config without its `vision_config`, same weights);
- TTFT warm ÷ cold: a ~2,000-token text prefix sent again; the second turn about an
  image after the first, both under the same ~2,000-token system prompt (cold: the same
  second turn in a fresh cache namespace: its whole prompt and the vision tower; the
  image's processed arrays are the worker's either way, worker/vision/processed.py). The
  image's own tokens are few on these models (16 on `tiny`): without the long prompt,
  both sides are the fixed cost of a request.
Goals (issue 33): 8 streams >= 0.9 x raw and above mlx_vlm.server; text-only >= 0.9 x
the text model; warm ÷ cold <= 0.05 (text prefix) and <= 0.1 (second image turn).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.make_model import MODELS_DIR
from bench.report import goal, print_table
from bench.serverproc import ServerProcess, free_port
from bench.throughput import MlxLmServer, stream_chat
from supervisor.workers import blas

WORDS = "the model reads every line of the repository and writes a careful plan".split()


def image_png(size: int, seed: int) -> bytes:
    from bench.multimodal import image_png as png

    return png(size, seed)


def messages(i: int, image: bytes | None) -> list[dict]:
    text = f"Tell me story number {i} about " + WORDS[i % 12]
    if image is None:
        return [{"role": "user", "content": text}]
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def served_rate(port: int, model: str, n: int, tokens: int, side: int | None,
                first: int = 0) -> float:
    """Aggregate tokens/s of n concurrent streamed chats (one image each, of `side`
    pixels, when given), as bench/throughput.py counts them: every token ÷ the wall time
    (prefill included, as the raw engine's)."""
    def one(i):
        image = image_png(side, first + i) if side else None
        return stream_chat(port, {"model": model, "messages": messages(first + i, image),
                                  "max_tokens": tokens, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - t0
    return sum(r["tokens"] for r in results) / elapsed


class Raw:
    """mlx-vlm in this process: `batch_generate` on the same chat prompts and images."""

    def __init__(self, path: Path):
        from mlx_vlm import load

        self.model, self.processor = load(str(path))

    def rate(self, n: int, tokens: int, side: int | None, first: int = 0) -> float | None:
        """Aggregate tokens/s; None where mlx-vlm's batch refuses these prompts (Gemma 3's
        processor takes no batch of image prompts through it in 0.7.10)."""
        import io

        from mlx_vlm.generate import batch_generate
        from PIL import Image

        # (batch_generate renders its prompts with the model's template itself.)
        prompts = [f"Tell me story number {i} about " + WORDS[i % 12]
                   for i in range(first, first + n)]
        images = [Image.open(io.BytesIO(image_png(side, i))) for i in range(first, first + n)
                  ] if side else []
        t0 = time.perf_counter()
        try:
            r = batch_generate(self.model, self.processor, images=images or None,
                               prompts=prompts, max_tokens=tokens)  # (greedy: no sampler)
        except ValueError as e:
            print(f"raw mlx-vlm refused {n} prompts with images={bool(side)}: {e}",
                  file=sys.stderr)
            return None
        return r.stats.generation_tokens / (time.perf_counter() - t0)


class MlxVlmServer(MlxLmServer):
    """`python -m mlx_vlm.server` on a free port, for the duration of a `with`."""

    def __init__(self, path):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_vlm.server", "--model", str(path), "--port",
             str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def text_copy(path: Path) -> Path:
    """The checkpoint as a text model: its files, its config without `vision_config`
    (mlx-lm's class of the family drops the vision weights as it loads)."""
    out = path.parent / (path.name + "-as-text")
    if not out.exists():
        tmp = path.parent / (out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("vision_config", None)
        (tmp / "config.json").write_text(json.dumps(config))
        tmp.rename(out)
    return out


def throughput(name: str, path: Path, tokens: int, streams: list[int], side: int,
               peer: bool = True) -> list:
    model, rows = str(path), []
    raw = Raw(path)
    raw.rate(2, 4, None, first=100)
    raw.rate(2, 4, side, first=100)  # compile
    raw_rate = {(n, s): raw.rate(n, tokens, s, 10 * n) for n in streams for s in (None, side)}
    del raw
    with ServerProcess([model], "--max-batch-size", str(max(streams))) as srv:
        srv.wait_healthy(timeout=300)
        served_rate(srv.port, model, 2, 4, side, first=100)
        mine = {(n, s): served_rate(srv.port, model, n, tokens, s, 10 * n)
                for n in streams for s in (None, side)}
    theirs = {}
    if peer:
        with MlxVlmServer(path) as srv:
            served_rate(srv.port, model, 2, 4, side, first=100)
            theirs = {(n, s): served_rate(srv.port, model, n, tokens, s, 10 * n)
                      for n in streams for s in (None, side)}
    as_text = text_copy(path)
    with ServerProcess([str(as_text)], "--max-batch-size", str(max(streams))) as srv:
        srv.wait_healthy(timeout=300)
        served_rate(srv.port, str(as_text), 2, 4, None, first=100)
        text = served_rate(srv.port, str(as_text), max(streams), tokens, None, 10 * max(streams))
    top = max(streams)
    for s, what in ((None, "text"), (side, "image")):
        for n in streams:
            r, m, t = raw_rate[n, s], mine[n, s], theirs.get((n, s))
            of = (lambda x: f" ({x / r:.2f})") if r else (lambda x: "")  # noqa: E731
            rows.append((f"{name} {what} {n} stream{'s' * (n > 1)}",
                         (f"raw {r:.0f} tok/s" if r else "raw refused") + f", mlxd {m:.0f}"
                         + of(m) + (f", mlx_vlm.server {t:.0f}" + of(t) if t is not None else ""),
                         goal(m / r, ">=", 0.9) if n == top and r else ""))
        if theirs:
            rows.append((f"{name} {what}: mlxd above mlx_vlm.server at {top}",
                         f"{mine[top, s]:.0f} vs {theirs[top, s]:.0f} tok/s",
                         "PASS" if mine[top, s] > theirs[top, s] else "MISS"))
    ratio = mine[top, None] / text
    rows.append((f"{name} text-only at {top}: vision checkpoint / as a text model",
                 f"{mine[top, None]:.0f} / {text:.0f} tok/s = {ratio:.2f}",
                 goal(ratio, ">=", 0.9)))
    return rows


def reuse(name: str, path: Path, prefix_words: int, side: int) -> list:
    model, rows = str(path), []
    with ServerProcess([model], "--prompt-cache-bytes", "1G", "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)

        def ask(msgs, key):
            return stream_chat(srv.port, {"model": model, "messages": msgs, "max_tokens": 8,
                                          "temperature": 0, "prompt_cache_key": key})

        ask(messages(0, image_png(side, 999)), "compile")
        system = [{"role": "system", "content": " ".join(WORDS[i % 12]
                                                          for i in range(prefix_words))}]
        long = system + [{"role": "user", "content": "Begin."}]
        cold, warm = ask(long, "text"), ask(long, "text")
        ratio = warm["ttft"] / cold["ttft"]
        rows.append((f"{name} {cold['usage'].get('prompt_tokens', 0)}-token text prefix: "
                     "warm / cold TTFT",
                     f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = {ratio:.3f}",
                     goal(ratio, "<=", 0.05)))
        first_turn = system + messages(1, image_png(side, 7))
        first = ask(first_turn, "image")
        second = first_turn + [{"role": "assistant", "content": first["text"]},
                               {"role": "user", "content": "And what colours are there?"}]
        warm, cold = ask(second, "image"), ask(second, "image-cold")
        ratio = warm["ttft"] / cold["ttft"]
        cached = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rows.append((f"{name} second turn about an image: warm / cold TTFT",
                     f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = {ratio:.3f} "
                     f"({cached} of {warm['usage'].get('prompt_tokens', 0)} tokens cached)",
                     goal(ratio, "<=", 0.1)))
    return rows


def vision_rows(size: str, family: str, quick: bool, peer: bool = True) -> list:
    from worker.demos.vision import SIZES, build_vision_model

    name = f"{size}-vision" + {"qwen3.5": "-hybrid", "gemma3": "-gemma3"}.get(family, "")
    path = build_vision_model(MODELS_DIR / name, size, family=family).path
    side = int(SIZES[size]["max_pixels"] ** 0.5)
    tokens = 16 if quick else 64 if size == "small" else 128
    rows = throughput(name, path, tokens, [1, 2] if quick else [1, 4, 8], side, peer)
    return rows + reuse(name, path, 200 if quick else 620, side)  # (~2,000 tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--family", choices=("qwen2-vl", "qwen3.5", "gemma3"), default="qwen2-vl")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peer", action="store_true",
                   help="without mlx_vlm.server (where its web stack is not installed)")
    args = p.parse_args()
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    print_table(f"python -m bench.vision_throughput --size {args.size} --family {args.family}",
                vision_rows(args.size, args.family, args.quick, not args.no_peer))


if __name__ == "__main__":
    main()
