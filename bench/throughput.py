"""Throughput and prompt reuse: mlxd against raw mlx-lm and mlx-lm's own server, in one run.

    python -m bench.throughput [--preset tiny|small|tiny-hybrid|small-hybrid|smollm2|all] [--quick]
    python -m bench.throughput --preset tiny-vision|small-vision|small-vision-hybrid|
                                        tiny-vision-gemma3|small-vision-gemma3 [--quick]

Per preset, at temperature 0, side by side:
- aggregate decode tokens/s at 1, 4 and 8 concurrent streams: raw mlx-lm `batch_generate`
  in-process (the ceiling), mlxd over HTTP, and `mlx_lm.server` (started here) with and
  without a `seed` in the requests; tokens are counted as each side really produced them;
- p95 inter-token latency at 8 streams ÷ at 1 stream, for mlxd and for raw (whose batch
  step time is the engine's own cost of a larger batch);
- prompt reuse (on the tiny attention and hybrid presets, where a 2000-token prefill takes
  well under a minute on a small CPU): TTFT of a ~2000-token system prompt cold and warm,
  and four agent conversations interleaved turn by turn for 5 turns, each turn the
  previous messages + the reply + a new message: per turn the smallest cached share of
  the prompt (usage.prompt_tokens_details.cached_tokens) and the largest TTFT ÷ the cold
  first turn.
Goals (issue "Throughput: continuous batching and prompt-prefix KV reuse"): at 8 streams
mlxd >= 0.9 x raw and above mlx-lm's server; p95 ITL 8 ÷ 1 <= 2; warm ÷ cold TTFT <=
0.03; every later agent turn >= 90% cached with TTFT <= 0.1 x the cold first turn.
The vision presets (not in `all`) run bench/vision_throughput.py: the same against raw
mlx-vlm and mlx-vlm's server, text-only and with images.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import statistics
import subprocess
import sys
import time

from bench.make_model import model_path
from bench.report import goal, print_table
from bench.serverproc import ServerProcess, free_port
from supervisor.workers import blas

PRESETS = ("tiny", "small", "tiny-hybrid", "small-hybrid")
# A real trained model (49K vocabulary: sampling costs what it costs on real models), not
# in `all`: about 7 tokens/s a stream on a 2-core CPU.
TRAINED = ("smollm2",)
REUSE_PRESETS = ("tiny", "tiny-hybrid")
# Vision checkpoints (bench/vision_throughput.py): preset → (size, family).
VISION = {"tiny-vision": ("tiny", "qwen2-vl"), "small-vision": ("small", "qwen2-vl"),
          "small-vision-hybrid": ("small", "qwen3.5"), "tiny-vision-gemma3": ("tiny", "gemma3"),
          "small-vision-gemma3": ("small", "gemma3")}
WORDS = "the model reads every line of the repository and writes a careful plan".split()


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me story number {i} about " + WORDS[i % 12]}]


# Reset before a response began: the request never reached the server's handler.
UNANSWERED = (ConnectionResetError, ConnectionRefusedError, http.client.RemoteDisconnected)
RESENT: collections.Counter = collections.Counter()  # port → requests sent again


def request(port: int, path: str, body: dict, retries: int = 0):
    """(connection, response) of a POST answered 200. mlx_lm.server listens with
    ThreadingHTTPServer's backlog of 5 connections: when 32 clients connect at once, the
    kernel resets those its accept queue cannot hold, after the request was sent and
    before any answer (ConnectionResetError reading the status line; with a backlog of
    128 none is reset). Such a request is sent again, up to `retries` times, after a
    short pause; mlxd's requests are never retried (retries=0), so its failures show."""
    for attempt in range(retries + 1):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            break
        except UNANSWERED:
            conn.close()
            if attempt == retries:
                raise
            RESENT[port] += 1
            time.sleep(0.05 * 2 ** attempt)
    assert resp.status == 200, resp.read()[:500]
    return conn, resp


def stream_chat(port: int, body: dict, retries: int = 0) -> dict:
    """One streamed chat completion: TTFT, the gaps between content chunks, tokens, and
    the time until the choice finished (`finish`: with max_tokens 1, the time to the first
    token even when that token's text is empty). `retries`: how often to send the request
    again when the server reset the connection before answering it (for a peer server
    only: see `request`); the times count from the first try."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn, resp = request(port, "/v1/chat/completions", body, retries)
    times, usage, text, finish = [], None, [], float("nan")
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        obj = json.loads(line[6:])
        usage = obj.get("usage") or usage
        choices = obj.get("choices") or []
        if choices and choices[0].get("finish_reason") is not None:
            finish = time.perf_counter() - t0
        if choices and (choices[0].get("delta") or {}).get("content"):
            times.append(time.perf_counter())
            text.append(choices[0]["delta"]["content"])
    conn.close()
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {"ttft": times[0] - t0 if times else float("nan"), "times": times,
            "tokens": tokens, "usage": usage or {}, "text": "".join(text), "finish": finish}


def concurrent_rate(port: int, model: str, n: int, tokens: int, seed: bool = False,
                    first: int = 0):
    """(aggregate tokens/s, [inter-chunk gaps / tokens per chunk]) of n streams at once,
    on questions first, first + 1, ... (the warm-up asks others: no prompt is cached)."""
    def body(i):
        b = {"model": model, "messages": question(first + i), "max_tokens": tokens,
             "temperature": 0}
        return {**b, "seed": 1000 + i} if seed else b

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        runs = list(pool.map(lambda i: stream_chat(port, body(i)), range(n)))
        elapsed = time.perf_counter() - t0
    gaps = []
    for r in runs:  # a chunk may carry several tokens: its gap is spread over them
        per_chunk = max(1.0, r["tokens"] / max(1, len(r["times"])))
        gaps += [(b - a) / per_chunk for a, b in zip(r["times"], r["times"][1:])]
    return sum(r["tokens"] for r in runs) / elapsed, gaps


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 20 else max(values)


class Raw:
    """mlx-lm in this process: `batch_generate` on the same chat prompts."""

    def __init__(self, path):
        from mlx_lm import load

        self.model, self.tokenizer = load(str(path))

    def rate(self, n: int, tokens: int, first: int = 0) -> tuple[float, float]:
        """(aggregate tokens/s, mean step time) of batch_generate over n prompts."""
        from mlx_lm.generate import batch_generate

        prompts = [self.tokenizer.apply_chat_template(question(first + i),
                                                      add_generation_prompt=True)
                   for i in range(n)]
        t0 = time.perf_counter()
        r = batch_generate(self.model, self.tokenizer, prompts, max_tokens=tokens,
                           return_token_ids=True)
        elapsed = time.perf_counter() - t0
        made = sum(len(t) for t in r.token_ids)
        return made / elapsed, elapsed / max(1, max(len(t) for t in r.token_ids))


class MlxLmServer:
    """`python -m mlx_lm.server` on a free port, for the duration of a `with`."""

    def __init__(self, path, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(path), "--port",
             str(self.port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("mlx_lm.server did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(15)


def throughput(preset: str, tokens: int, streams: list[int]) -> list:
    path = model_path(preset, None)
    model = str(path)
    rows = []
    raw = Raw(path)
    raw.rate(2, 4, first=100)  # compile
    # Each measurement asks its own questions, so no server reuses a prompt it saw.
    offset = {n: 10 * k for k, n in enumerate(streams)}
    raw_rate = {n: raw.rate(n, tokens, offset[n]) for n in streams}
    del raw
    with ServerProcess([model], "--max-batch-size", str(max(streams))) as srv:
        srv.wait_healthy(timeout=300)
        concurrent_rate(srv.port, model, 2, 4, first=100)
        mine = {n: concurrent_rate(srv.port, model, n, tokens, first=offset[n])
                for n in streams}
    with MlxLmServer(path) as peer:
        concurrent_rate(peer.port, model, 2, 4, first=100)
        theirs = {n: concurrent_rate(peer.port, model, n, tokens, first=offset[n])[0]
                  for n in streams}
        seeded = {n: concurrent_rate(peer.port, model, n, tokens, seed=True,
                                     first=50 + offset[n])[0]
                  for n in streams}
    for n in streams:
        ratio = mine[n][0] / raw_rate[n][0]
        rows.append((f"{preset} {n} stream{'s' * (n > 1)}",
                     f"raw {raw_rate[n][0]:.0f} tok/s, mlxd {mine[n][0]:.0f} "
                     f"({ratio:.2f}), mlx_lm.server {theirs[n]:.0f} "
                     f"({theirs[n] / raw_rate[n][0]:.2f}), with seed {seeded[n]:.0f} "
                     f"({seeded[n] / raw_rate[n][0]:.2f})",
                     goal(ratio, ">=", 0.9) if n == max(streams) else ""))
    top, one = max(streams), min(streams)
    rows.append((f"{preset} mlxd above mlx_lm.server at {top}",
                 f"{mine[top][0]:.0f} vs {max(theirs[top], seeded[top]):.0f} tok/s",
                 "PASS" if mine[top][0] > max(theirs[top], seeded[top]) else "MISS"))
    itl = p95(mine[top][1]) / p95(mine[one][1])
    raw_itl = raw_rate[top][1] / raw_rate[one][1]
    rows.append((f"{preset} p95 ITL {top} / {one} streams",
                 f"mlxd {itl:.2f} ({p95(mine[top][1]) * 1e3:.1f} / "
                 f"{p95(mine[one][1]) * 1e3:.1f} ms); raw step time {raw_itl:.2f}",
                 goal(itl, "<=", 2)))
    return rows


def reuse(preset: str, system_words: int, turns: int, conversations: int) -> list:
    path = model_path(preset, None)
    model = str(path)
    system = " ".join(WORDS[i % 12] for i in range(system_words))
    rows = []
    with ServerProcess([model], "--prompt-cache-bytes", "1G", "--kv-budget", "2G") as srv:
        srv.wait_healthy(timeout=300)

        def ask(messages, key=None):
            body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
            if key:
                body["prompt_cache_key"] = key
            return stream_chat(srv.port, body)

        base = [{"role": "system", "content": system}]
        cold = ask(base + [{"role": "user", "content": "Begin."}])
        warm = ask(base + [{"role": "user", "content": "Begin."}])
        n_prompt = cold["usage"].get("prompt_tokens", 0)
        ratio = warm["ttft"] / cold["ttft"]
        rows.append((f"{preset} {n_prompt}-token prompt: warm / cold TTFT",
                     f"{warm['ttft'] * 1e3:.1f} / {cold['ttft'] * 1e3:.1f} ms = {ratio:.3f}",
                     goal(ratio, "<=", 0.03)))
        # Agents: each its own conversation (and cache namespace), interleaved by turn.
        first = ask(base + [{"role": "user", "content": "Agent cold."}], key="cold")["ttft"]
        talks = [base + [{"role": "user", "content": f"Agent {a}: start the task."}]
                 for a in range(conversations)]
        per_turn = []
        for turn in range(turns):
            shares, ttfts = [], []
            for a in range(conversations):
                r = ask(talks[a], key=f"agent-{a}")
                usage = r["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                shares.append(cached / usage["prompt_tokens"])
                ttfts.append(r["ttft"] / first)
                talks[a] = talks[a] + [{"role": "assistant", "content": r["text"]},
                                       {"role": "user", "content": f"Step {turn + 2}."}]
            per_turn.append((min(shares), max(ttfts)))
        for t, (share, ttft) in enumerate(per_turn[1:], start=2):
            ok = share >= 0.9 and ttft <= 0.1
            rows.append((f"{preset} agent turn {t} ({conversations} interleaved)",
                         f"cached >= {share:.1%} of the prompt, TTFT <= {ttft:.3f} x cold",
                         f"goal >= 90% and <= 0.1: {'PASS' if ok else 'MISS'}"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=(*PRESETS, *TRAINED, *VISION, "all"), default="all")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per stream (default 256; 64 on the small presets, 32 on smollm2)")
    p.add_argument("--quick", action="store_true", help="a smoke run: few tokens and turns")
    args = p.parse_args()
    presets = PRESETS if args.preset == "all" else (args.preset,)
    rows = []
    for preset in presets:
        if preset in VISION:
            from bench.vision_throughput import vision_rows

            rows += vision_rows(*VISION[preset], args.quick)
            continue
        tokens = args.tokens or (16 if args.quick else 32 if preset in TRAINED
                                 else 64 if "small" in preset else 256)
        rows += throughput(preset, tokens, [1, 2] if args.quick else [1, 4, 8])
        if preset in REUSE_PRESETS:
            rows += reuse(preset, 200 if args.quick else 640, 2 if args.quick else 5,
                          2 if args.quick else 4)
    print_table(f"python -m bench.throughput --preset {args.preset}"
                f"{' --quick' if args.quick else ''}", rows)


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
