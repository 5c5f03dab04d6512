"""mlxd over HTTP streaming against raw in-process mlx-lm, same model, same prompt, one run.

    python -m bench.serve_vs_engine --preset tiny|small  [--model PATH] [--tokens N] [--rounds R]

Prints:
- decode tokens/s of mlxd ÷ raw `mlx_lm.stream_generate` (goals: ≥ 0.97 small, ≥ 0.90 tiny)
- TTFT overhead: mlxd's time to first token − the engine's, in ms (goal ≤ 10 ms)
- cancellation ratio: latency of a short request sent right after a client abandons a
  2000-token stream ÷ the same request on an idle server (goal ≤ 1.2, on tiny)
Rounds alternate engine and server so drift on this noisy machine hits both alike; the
table shows medians.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time

from bench.make_model import PRESET_NAMES, model_path
from bench.report import goal, print_table
from bench.serverproc import ServerProcess
from supervisor.workers import blas

PROMPT = "Write a long story about a robot who learns to paint, with many details."
GOALS = {"tiny": 0.90, "small": 0.97}


def engine_run(model, tokenizer, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, decode tokens/s, tokens) of raw stream_generate at temperature 0."""
    from mlx_lm import stream_generate

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True)
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        now = time.perf_counter()
        if first is None:
            first = now
        last = now
        n = r.generation_tokens
    return first - t0, (n - 1) / (last - first), n


def server_stream(port: int, model: str, max_tokens: int, *, abandon_after: int | None = None):
    """Stream a chat completion; (ttft_s, decode tokens/s, tokens). With `abandon_after`,
    close the connection after that many chunks instead."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = last = None
    chunks = 0
    tokens = 0
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += 1
            if abandon_after is not None and chunks >= abandon_after:
                conn.sock.close()  # the client leaves mid-stream
                conn.close()
                return None
    conn.close()
    return first - t0, (tokens - 1) / (last - first) if last > first else float("nan"), tokens


def short_request(port: int, model: str) -> float:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 8, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    conn.close()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.serve_vs_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    p.add_argument("--model", help="a local model directory instead of a preset")
    p.add_argument("--tokens", type=int, default=None, help="tokens per generation")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cancel-rounds", type=int, default=11)
    args = p.parse_args()
    path = model_path(args.preset, args.model)
    tokens = args.tokens or (512 if args.preset == "tiny" else 128)

    from mlx_lm import load

    model, tokenizer = load(str(path))
    engine_run(model, tokenizer, 16)  # warm-up (compilation, allocator)

    server = ServerProcess([str(path)])
    try:
        server.wait_healthy()
        name = str(path)  # a path's id is the path as given
        server_stream(server.port, name, 16)  # warm-up
        e_ttft, e_tps, s_ttft, s_tps = [], [], [], []
        for _ in range(args.rounds):
            t, r, n_e = engine_run(model, tokenizer, tokens)
            e_ttft.append(t)
            e_tps.append(r)
            t, r, n_s = server_stream(server.port, name, tokens)
            s_ttft.append(t)
            s_tps.append(r)
        # Interleaved, so drift on this noisy machine hits both sides alike.
        idle, after = [], []
        for _ in range(args.cancel_rounds):
            idle.append(short_request(server.port, name))
            server_stream(server.port, name, 2000, abandon_after=5)
            after.append(short_request(server.port, name))
    finally:
        server.stop()

    ratio = statistics.median(s_tps) / statistics.median(e_tps)
    ttft_ms = (statistics.median(s_ttft) - statistics.median(e_ttft)) * 1000
    cancel_ratio = statistics.median(after) / statistics.median(idle)
    target = GOALS.get(args.preset, 0.97)
    rows = [
        ("model", f"{args.model or args.preset} ({path})", ""),
        ("tokens per run / rounds", f"{tokens} / {args.rounds} (server produced {n_s}, engine {n_e})", ""),
        ("engine decode tok/s (median)", f"{statistics.median(e_tps):.1f}", ""),
        ("mlxd decode tok/s (median)", f"{statistics.median(s_tps):.1f}", ""),
        ("decode ratio mlxd/engine", f"{ratio:.3f}", goal(ratio, ">=", target)),
        ("engine TTFT ms (median)", f"{statistics.median(e_ttft) * 1000:.1f}", ""),
        ("mlxd TTFT ms (median)", f"{statistics.median(s_ttft) * 1000:.1f}", ""),
        ("TTFT overhead ms", f"{ttft_ms:.1f}", goal(ttft_ms, "<=", 10)),
        ("short request idle ms (median)", f"{statistics.median(idle) * 1000:.1f}", ""),
        ("short request after abandon ms", f"{statistics.median(after) * 1000:.1f}", ""),
        ("cancellation ratio", f"{cancel_ratio:.3f}", goal(cancel_ratio, "<=", 1.2)),
    ]
    print_table(f"python -m bench.serve_vs_engine --preset {args.preset}", rows)


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
