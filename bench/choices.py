"""A request's `n` choices of a long prompt: one prefill for all (supervisor/api/choices.py,
worker/loop/batch.py `same`) against the same prompt prefilled once per choice, in one run
on one server.

    python -m bench.choices [--model demo] [--prompt-words 1500] [--n 4] [--tokens 16]
        [--rounds 3]

Sides, each round in turn (a fresh prompt_cache_key each time: nothing cached before):
- one: the request alone (n = 1);
- n choices: `n` on one request (the prompt prefilled once, its repeats starting from it);
- n requests: `n` requests at once, each in a namespace of its own (the prompt prefilled
  once per request: what `n` cost before).
Wall time of each (all choices finished) and its ratio to one request; the medians.
Goal: n choices within 1.5 x one request's time where n requests take about n x (on a
compute-bound prefill: a long prompt, a CPU or any GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

from bench.report import goal, print_table
from bench.serverproc import ServerProcess
from bench.throughput import request


def post(port: int, body: dict) -> dict:
    """A chat completion's whole answer (bench/throughput.py `request`: a 200 or raise)."""
    conn, resp = request(port, "/v1/chat/completions", body)
    try:
        return json.loads(resp.read())
    finally:
        conn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--prompt-words", type=int, default=1500)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    words = " ".join(f"item{i} is here" for i in range(a.prompt_words // 3))
    body = {"model": a.model, "max_tokens": a.tokens, "temperature": 0,
            "messages": [{"role": "user", "content": words + " Summarise."}]}
    got = {"one": [], f"{a.n} choices": [], f"{a.n} requests": []}
    with ServerProcess([a.model]) as srv, \
            concurrent.futures.ThreadPoolExecutor(a.n) as pool:
        srv.wait_healthy(600)
        post(srv.port, {**body, "max_tokens": 2, "prompt_cache_key": "warm"})
        for r in range(a.rounds):
            t = time.perf_counter()
            one = post(srv.port, {**body, "prompt_cache_key": f"one{r}"})
            got["one"].append(time.perf_counter() - t)
            t = time.perf_counter()
            many = post(srv.port, {**body, "n": a.n, "prompt_cache_key": f"n{r}"})
            got[f"{a.n} choices"].append(time.perf_counter() - t)
            texts = {c["message"]["content"] for c in many["choices"]}
            assert texts == {one["choices"][0]["message"]["content"]}, texts
            t = time.perf_counter()
            list(pool.map(lambda i: post(srv.port, {**body, "prompt_cache_key": f"r{r}-{i}"}),
                          range(a.n)))
            got[f"{a.n} requests"].append(time.perf_counter() - t)
    base = statistics.median(got["one"])
    tokens = one["usage"]["prompt_tokens"]
    rows = []
    for name, times in got.items():
        m = statistics.median(times)
        rows.append((f"{name}: all finished", f"{m:.2f} s ({m / base:.2f} x one)",
                     goal(m / base, "<=", 1.5) if name.endswith("choices") else ""))
    print_table(f"bench.choices: {a.model}, a {tokens}-token prompt, {a.tokens} tokens each, "
                f"{a.rounds} rounds (medians)", rows)


if __name__ == "__main__":
    main()
