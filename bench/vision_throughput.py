"""Throughput and prompt reuse of a vision-language checkpoint: mlxd against raw mlx-vlm and
mlx-vlm's own server, in one run (the vision presets of bench/throughput.py).

    python -m bench.vision_throughput [--size tiny|small|2b]
                                      [--family qwen2-vl|qwen3.5|gemma3|gemma4|gemma4-31b]
                                      [--quick] [--no-peer] [--only throughput|reuse]
                                      [--rounds N] [--pairs N] [--dtype D] [--layers N]
                                      [--streams 1,4,8] [--trace]

The model: a random-weight vision checkpoint built locally (worker/demos/vision.py:
`small` is hidden 512, 8 language layers, a 4-layer vision tower, images of up to
448×448 = 256 image tokens; `2b` Qwen2-VL-2B's language model, 1.3-2.5B parameters by
family, for a GPU, where `small`'s 2,000-token prefill is 20-90 ms and a warm request's
fixed cost most of the warm ÷ cold ratio; `qwen3.5` its hybrid linear-attention family,
`gemma3` Gemma 3's, a sliding window every other layer, `gemma4` Gemma 4's (E2B's
layout), shared-KV layers and per-layer inputs besides, `gemma4-31b` the large Gemma 4
layout, images attended both ways), in bf16 on a GPU and float32
on the CPU (`--dtype`; `--layers N` builds the size with N language layers, a quick check
of its code path on the CPU). At temperature 0, side by side:
- aggregate decode tokens/s at 1, 4 and 8 concurrent streams, text-only and with one
  image each (a different image per stream): raw mlx-vlm `batch_generate` in-process,
  mlxd over HTTP, and `mlx_vlm.server` (started here); raw and mlxd in `--pairs`
  rounds side by side, their order alternating, the ratio the rounds' geometric mean
  with its 95% interval (3 on a lent GPU, whose host's speed drifts);
- text-only requests on the vision checkpoint ÷ the same language model served as a
  text model (the checkpoint's config without its `vision_config`, same weights), both
  servers up at once, the text model's rounds in turn with the widest text rounds;
- TTFT warm ÷ cold: a ~2,000-token text prefix sent again; the second turn about an
  image after the first, both under the same ~2,000-token system prompt (cold: the same
  second turn in a fresh cache namespace: its whole prompt and the vision tower; the
  image's processed arrays are the worker's either way, worker/vision/processed.py). The
  image's own tokens are few on these models (16 on `tiny`): without the long prompt,
  both sides are the fixed cost of a request. `--rounds` times, each in fresh cache
  namespaces, the last round reported (the first pays MLX's compile of each new shape,
  a few hundred ms on a GPU); beside them raw mlx-lm's own warm ÷ cold in-process on the
  same ids (the checkpoint as a text model: a copy of the 2,000 tokens' cache, then the
  last token), the floor a server's ratio can reach on that model and device.
Goals (issue 33): 8 streams >= 0.9 x raw and above mlx_vlm.server; text-only >= 0.9 x
the text model; warm ÷ cold <= 0.05 (text prefix) and <= 0.1 (second image turn).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.make_model import MODELS_DIR
from bench.report import alternate, goal, print_table
from bench.serverproc import ServerProcess, free_port
from bench.throughput import MlxLmServer, stream_chat
from bench.worker_timeline import read_trace, step_summary, trace_env
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


class Served(float):
    """A served side's aggregate tokens/s (the float), with where its wall time went:
    the streams' median and longest TTFT (s) and the rate from the first stream's first
    token to the last one's last (`decode`, tok/s). A 2b Gemma 4 on an H200 spent most of
    a 64-token wave waiting for first tokens (8 streams: median TTFT 1.0-1.5 s)."""

    def __new__(cls, rate: float, ttft: list, decode: float):
        self = super().__new__(cls, rate)
        self.ttft = sorted(t for t in ttft if t == t)
        self.decode = decode
        return self

    def note(self) -> str:
        if not self.ttft:
            return ""
        return (f"; TTFT median {self.ttft[len(self.ttft) // 2] * 1e3:.0f} ms, longest "
                f"{self.ttft[-1] * 1e3:.0f}; {self.decode:.0f} tok/s first to last token")


def served_rate(port: int, model: str, n: int, tokens: int, side: int | None,
                first: int = 0) -> Served:
    """Aggregate tokens/s of n concurrent streamed chats (one image each, of `side`
    pixels, when given), as bench/throughput.py counts them: every token ÷ the wall time
    (prefill included, as the raw engine's); with its TTFTs (`Served`)."""
    def one(i):
        image = image_png(side, first + i) if side else None
        return stream_chat(port, {"model": model, "messages": messages(first + i, image),
                                  "max_tokens": tokens, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    times = [t for r in results for t in r["times"]]
    span = max(times) - min(times) if len(times) > 1 else 0.0
    return Served(tokens / elapsed, [r["ttft"] for r in results],
                  tokens / span if span > 0 else float("nan"))


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
        shutil.copytree(path.resolve(), tmp, copy_function=os.symlink)  # (GBs of weights)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("vision_config", None)
        (tmp / "config.json").unlink()  # (a link to the checkpoint's own)
        (tmp / "config.json").write_text(json.dumps(config))
        tmp.rename(out)
    return out


def throughput(name: str, path: Path, tokens: int, streams: list[int], side: int,
               peer: bool = True, pairs: int = 1, trace: bool = False) -> list:
    """The table's rate rows. Raw and mlxd run side by side, `pairs` rounds of each width,
    the sides' order alternating (bench/report.py `alternate`), each round on new chats
    (no prefix hits): on a lent GPU the host's speed drifts between phases minutes apart
    (session 13: decode steps of 22 and of 42 ms an hour apart), so a ratio of figures
    measured minutes apart says more about the host than about mlxd. The ratio is the
    rounds' geometric mean, with its 95% interval from 2 pairs up."""
    model, rows = str(path), []
    raw = Raw(path)
    # Both sides run the widest batch once before measuring (a GPU compiles by shape: a
    # server meets its widths once in hours, and mlxd's worker runs them at load on a
    # GPU, worker/loop/warmup.py); what is measured is the steady state.
    top = max(streams)
    for s in (None, side):
        raw.rate(top, 4, s, first=100)
    got = {}
    # The checkpoint served as a text model runs beside, its widest text rounds in turn
    # with the others (alone after them, it read the host's phase minutes later: 0.63-0.98
    # of the vision checkpoint between leases, the same rates when alternated, session 14).
    as_text = text_copy(path)
    tmp = tempfile.TemporaryDirectory(prefix="mlxd-vt-") if trace else None
    envs = [trace_env(os.path.join(tmp.name, k)) if tmp else None for k in ("vision", "text")]
    with ServerProcess([model], "--max-batch-size", str(max(streams)), env=envs[0]) as srv, \
            ServerProcess([str(as_text)], "--max-batch-size", str(max(streams)),
                          env=envs[1]) as text_srv:
        srv.wait_healthy(timeout=300)
        text_srv.wait_healthy(timeout=300)
        for s in (None, side):
            served_rate(srv.port, model, top, 4, s, first=100)
        served_rate(text_srv.port, str(as_text), top, 4, None, first=100)
        for s in (None, side):
            for n in streams:
                served = []

                def mine(i, n=n, s=s, served=served):
                    served.append(served_rate(srv.port, model, n, tokens, s, 10 * n + 1000 * i))
                    return served[-1]

                sides = {"raw": lambda i, n=n, s=s: raw.rate(
                    n, tokens, s, 10 * n + 1000 * i) or float("nan"), "mlxd": mine}
                if n == top and s is None:
                    sides["as text"] = lambda i, n=n: served_rate(
                        text_srv.port, str(as_text), n, tokens, None, 10 * n + 1000 * i + 500)
                got[n, s] = (alternate(pairs, sides, label=f"{n} x {'image' if s else 'text'}"),
                             served[-1])
    raw = None  # (its memory back before the peer loads)
    if tmp:  # (the workers' steps over every round, bench/worker_timeline.py)
        for k, what in (("vision", "the vision checkpoint"), ("text", "as a text model")):
            print(f"{what}'s worker: {step_summary(read_trace(os.path.join(tmp.name, k)), top)}",
                  file=sys.stderr)
        tmp.cleanup()
    theirs = {}
    if peer:
        with MlxVlmServer(path) as srv:
            for s in (None, side):
                served_rate(srv.port, model, top, 4, s, first=100)
            theirs = {(n, s): served_rate(srv.port, model, n, tokens, s, 10 * n)
                      for n in streams for s in (None, side)}
    for s, what in ((None, "text"), (side, "image")):
        for n in streams:
            rounds, last = got[n, s]
            r, m = (statistics.median(rounds.figures[k]) for k in ("raw", "mlxd"))
            t = theirs.get((n, s))
            ratio = rounds.ratio("mlxd", "raw")
            of = (lambda x: f" ({x / r:.2f})") if r == r else (lambda x: "")  # noqa: E731
            mine_of = (f" ({ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}])" if pairs > 1
                       else of(m)) if r == r else ""
            rows.append((f"{name} {what} {n} stream{'s' * (n > 1)}",
                         (f"raw {r:.0f} tok/s" if r == r else "raw refused")
                         + f", mlxd {m:.0f}" + mine_of
                         + (f", mlx_vlm.server {t:.0f}" + of(t) if t is not None else "")
                         + (last.note() if n > 1 else ""),
                         goal(ratio[0], ">=", 0.9) if n == top and r == r else ""))
        if theirs:
            m = statistics.median(got[top, s][0].figures["mlxd"])
            rows.append((f"{name} {what}: mlxd above mlx_vlm.server at {top}",
                         f"{m:.0f} vs {theirs[top, s]:.0f} tok/s",
                         "PASS" if m > theirs[top, s] else "MISS"))
    rounds = got[top, None][0]
    mine_top, text = (statistics.median(rounds.figures[k]) for k in ("mlxd", "as text"))
    ratio = rounds.ratio("mlxd", "as text")
    rows.append((f"{name} text-only at {top}: vision checkpoint / as a text model",
                 f"{mine_top:.0f} / {text:.0f} tok/s = {ratio[0]:.2f}"
                 + (f" [{ratio[1]:.2f}-{ratio[2]:.2f}]" if pairs > 1 else ""),
                 goal(ratio[0], ">=", 0.9)))
    return rows


def raw_floor(path: Path, msgs: list, rounds: int) -> tuple[float, float]:
    """(warm, cold) TTFT s of raw mlx-lm in-process on the checkpoint as a text model:
    `msgs`' templated ids from scratch, and their last token from a copy of the cache of
    the rest (bench/gpu.py's Raw); the last of `rounds`."""
    from bench.gpu import Raw

    raw = Raw(text_copy(path))
    ids = list(raw.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    for _ in range(rounds):
        cold = raw.stream(ids, 2)[0]
        warm = raw.warm_prefix(ids[:-1], ids[-1:])
    return warm, cold


def reuse(name: str, path: Path, prefix_words: int, side: int, rounds: int = 2) -> list:
    model, rows = str(path), []
    system = [{"role": "system", "content": " ".join(WORDS[i % 12]
                                                      for i in range(prefix_words))}]
    long = system + [{"role": "user", "content": "Begin."}]
    with ServerProcess([model], "--prompt-cache-bytes", "1G", "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)

        def ask(msgs, key):
            # (TTFT: until the first token's chunk, whatever its text: a random model's
            # first tokens are often pieces of a character, held back until it is whole.)
            r = stream_chat(srv.port, {"model": model, "messages": msgs, "max_tokens": 1,
                                       "temperature": 0, "prompt_cache_key": key})
            return {**r, "ttft": r["finish"]}

        ask(messages(0, image_png(side, 999)), "compile")
        first_turn = system + messages(1, image_png(side, 7))
        for r in range(max(1, rounds)):  # (fresh namespaces each round; the last counts)
            text = ask(long, f"text{r}"), ask(long, f"text{r}")
            # Other last messages after the same prefix: the first parts from the prompts
            # before it (a cache that cannot be trimmed keeps its state there), the next
            # starts there; against the same prompt cold in a namespace of its own.
            asks = [system + [{"role": "user", "content": f"Begin part {k}."}] for k in (1, 2)]
            ask(asks[0], f"text{r}")
            question = ask(asks[1], f"text{r}"), ask(asks[1], f"question-cold{r}")
            ask(first_turn, f"image{r}")
            other_image = system + messages(1, image_png(side, 8))  # (the same words before)
            other = ask(other_image, f"image{r}"), ask(other_image, f"other-cold{r}")
            # (A reply of our own: random weights can say an image marker, which the
            # processor then counts as an image the request lacks, a 400.)
            second = first_turn + [{"role": "assistant", "content": "A few coloured shapes."},
                                   {"role": "user", "content": "And what colours are there?"}]
            image = ask(second, f"image{r}"), ask(second, f"image-cold{r}")
    (cold, warm), (warm_image, cold_image) = text, image
    ratio = warm["ttft"] / cold["ttft"]
    rows.append((f"{name} {cold['usage'].get('prompt_tokens', 0)}-token text prefix: "
                 "warm / cold TTFT",
                 f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = {ratio:.3f}",
                 goal(ratio, "<=", 0.05)))
    raw_warm, raw_cold = raw_floor(path, long, max(2, rounds))
    rows.append((f"{name} the same prefix, raw mlx-lm in-process: warm / cold TTFT",
                 f"{raw_warm * 1e3:.1f} / {raw_cold * 1e3:.1f} ms = {raw_warm / raw_cold:.3f}",
                 ""))
    for label, (warm, cold) in (("another last message", question),
                                ("another image", other)):
        cached = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rows.append((f"{name} the same prefix, {label}: warm / cold TTFT",
                     f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = "
                     f"{warm['ttft'] / cold['ttft']:.3f} ({cached} of "
                     f"{warm['usage'].get('prompt_tokens', 0)} tokens cached)", ""))
    warm, cold = warm_image, cold_image
    ratio = warm["ttft"] / cold["ttft"]
    cached = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    rows.append((f"{name} second turn about an image: warm / cold TTFT",
                 f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = {ratio:.3f} "
                 f"({cached} of {warm['usage'].get('prompt_tokens', 0)} tokens cached)",
                 goal(ratio, "<=", 0.1)))
    return rows


def vision_rows(size: str, family: str, quick: bool, peer: bool = True,
                only: str | None = None, rounds: int = 2, dtype: str = "float32",
                layers: int | None = None, pairs: int = 1,
                streams: list[int] | None = None, trace: bool = False) -> list:
    from worker.demos.vision import SIZES, build_vision_model

    name = f"{size}-vision" + {"qwen3.5": "-hybrid", "gemma3": "-gemma3",
                                  "gemma4": "-gemma4", "gemma4-31b": "-gemma4-31b"}.get(family, "")
    # (tiny and small keep their names: float32, as the other benchmarks build them)
    built = name + (f"-{dtype}" if dtype != "float32" else "") + (f"-{layers}L" if layers else "")
    t0 = time.perf_counter()
    path = build_vision_model(MODELS_DIR / built, size, family=family, dtype=dtype,
                              layers=layers).path
    print(f"{built}: built or found in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    side = int(SIZES[size]["max_pixels"] ** 0.5)
    tokens = 16 if quick else 128 if size == "tiny" else 64
    rows = []
    if only in (None, "throughput"):
        rows += throughput(name, path, tokens, streams or ([1, 2] if quick else [1, 4, 8]),
                           side, peer, pairs, trace)
    if only in (None, "reuse"):  # (~2,000 tokens)
        rows += reuse(name, path, 200 if quick else 620, side, rounds)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("tiny", "small", "2b"), default="tiny")
    p.add_argument("--family", choices=("qwen2-vl", "qwen3.5", "gemma3", "gemma4", "gemma4-31b"),
                   default="qwen2-vl")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peer", action="store_true",
                   help="without mlx_vlm.server (where its web stack is not installed)")
    p.add_argument("--only", choices=("throughput", "reuse"), default=None)
    p.add_argument("--rounds", type=int, default=2, help="of the warm / cold rows")
    p.add_argument("--pairs", type=int, default=1,
                   help="rounds of raw and mlxd side by side at each width (3 on a GPU)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU) or float32")
    p.add_argument("--streams", default=None, help="the widths, e.g. 8 (default 1,4,8)")
    p.add_argument("--trace", action="store_true",
                   help="trace both servers' workers: their steps' times after the table")
    p.add_argument("--layers", type=int, default=None,
                   help="the size's language layers but N (a quick check on the CPU)")
    args = p.parse_args()
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    from bench.gpu import default_dtype

    print_table(" ".join(["python -m bench.vision_throughput"] + sys.argv[1:]),
                vision_rows(args.size, args.family, args.quick, not args.no_peer, args.only,
                            args.rounds, default_dtype(args.dtype), args.layers, args.pairs,
                            [int(n) for n in args.streams.split(",")] if args.streams else None,
                            args.trace))


if __name__ == "__main__":
    main()
