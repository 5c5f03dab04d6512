"""What the lockstep of a worker group costs: one model served by one process vs by a
group of ranks on this machine, in one run.

    python -m bench.multihost [--shapes tiny,0.5b] [--ranks 2] [--rounds 3] [--tokens 128]

Random-weight models of bench/gpu.py's Qwen2.5 shapes (bf16 on a GPU, float32 on the
CPU). Two servers run side by side: `mlxd --model M` and `mlxd --model M --hosts H`,
H naming this machine once per rank (the ring backend on loopback by default; `--backend
nccl` on a host with a GPU per rank), tensor-sharded by default. Rounds alternate the two (so
drift hits both); a first round, not counted, compiles every kernel shape. Figures are
medians with their spread: single-stream decode tokens/s and TTFT (a 32-token prompt),
and the aggregate tokens/s of 8 concurrent streams. The ratio is group / one process:
on one machine whose one GPU (or CPU) every rank shares, a group can only lose (it adds
collectives and the control channel to the same compute); across GPUs or hosts it
splits the compute, and the ratio says what that buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.gpu import build, default_dtype, server_many, server_stream
from bench.report import print_table
from bench.serverproc import ServerProcess
from supervisor.workers import blas


def hostfile(folder: Path, ranks: int, backend: str) -> Path:
    path = folder / f"hosts-{ranks}.json"
    path.write_text(json.dumps({"backend": backend, "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(ranks)]}))
    return path


def measure(server: ServerProcess, model: str, tokens: int, streams: int, salt: int) -> dict:
    prompt = [100 + (salt * 7 + i) % 1000 for i in range(32)]
    ttft, rate, _ = server_stream(server.port, model, prompt, tokens)
    prompts = [[200 + (salt * 13 + s * 31 + i) % 1000 for i in range(32)]
               for s in range(streams)]
    return {"ttft": ttft, "decode": rate, "many": server_many(server.port, model, prompts,
                                                                tokens)}


def run_shape(shape: str, dtype: str, ranks: int, backend: str, sharding: str, rounds: int,
              tokens: int, streams: int, kv_budget: str) -> list:
    model = str(build(shape, dtype))
    common = ["--kv-budget", kv_budget, "--prompt-cache-bytes", "0", "--max-batch-size",
              str(max(8, streams))]
    with tempfile.TemporaryDirectory(prefix="mlxd-multihost-") as tmp:
        hosts = hostfile(Path(tmp), ranks, backend)
        with ServerProcess([model], *common) as one, \
                ServerProcess([model], "--hosts", str(hosts), "--sharding", sharding,
                              *common) as group:
            one.wait_healthy(600)
            group.wait_healthy(300)
            print(f"{shape}: both servers ready", file=sys.stderr, flush=True)
            results: dict[str, list] = {"one": [], "group": []}
            for r in range(rounds + 1):
                order = [("one", one), ("group", group)]
                for name, server in order if r % 2 else reversed(order):
                    m = measure(server, model, tokens, streams, r)
                    print(f"{shape} round {r} {name}: {m}", file=sys.stderr, flush=True)
                    if r:  # round 0 compiles
                        results[name].append(m)
    rows = []

    def row(label, key, unit):
        one = [m[key] for m in results["one"]]
        grp = [m[key] for m in results["group"]]
        a, b = statistics.median(one), statistics.median(grp)
        rows.append((f"{shape} {label}",
                     f"1 process {a:.4g} [{min(one):.4g}-{max(one):.4g}] {unit}, "
                     f"{ranks} ranks {b:.4g} [{min(grp):.4g}-{max(grp):.4g}]",
                     f"ratio {b / a:.3f}"))

    row("single-stream decode", "decode", "tok/s")
    row("single-stream TTFT", "ttft", "s")
    row(f"{streams} streams", "many", "tok/s")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--sharding", default="tensor", choices=("tensor", "pipeline"))
    p.add_argument("--backend", default="ring", help="ring (ranks may share a device) or "
                   "nccl (one CUDA GPU per rank)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-budget", default=None)
    args = p.parse_args()

    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    dtype = default_dtype(args.dtype)
    backend = args.backend
    info = mx.device_info()
    rows = []
    for shape in args.shapes.split(","):
        rows += run_shape(shape, dtype, args.ranks, backend, args.sharding, args.rounds,
                          args.tokens, args.streams,
                          args.kv_budget or ("24G" if gpu else "2G"))
    print_table(f"worker group ({args.ranks} ranks, {args.sharding}, {backend}) vs one "
                f"process: {info.get('device_name', info.get('architecture', 'cpu'))} "
                f"(MLX {mx.__version__}, {dtype}, {args.rounds} rounds, {args.tokens} "
                f"tokens)", rows)


if __name__ == "__main__":
    blas.reexec()
    main()
