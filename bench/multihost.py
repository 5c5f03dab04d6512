"""What the lockstep of a worker group costs: one model served by one process vs by a
group of ranks on this machine, in one run.

    python -m bench.multihost [--shapes tiny,0.5b] [--ranks 2] [--rounds 8] [--tokens 128]
    python -m bench.multihost --fits-across [--shapes 7b] [--backend nccl]

Random-weight models of bench/gpu.py's Qwen2.5 shapes (bf16 on a GPU, float32 on the
CPU). Two servers run side by side: `mlxd --model M` and `mlxd --model M --hosts H`,
H naming this machine once per rank (the ring backend on loopback by default; `--backend
nccl` on a host with a GPU per rank), tensor-sharded by default. Rounds alternate the two (so
drift hits both); a first round, not counted, compiles every kernel shape. Figures are
medians and the paired ratio with its 95% interval (bench/report.py): single-stream decode
tokens/s and TTFT (a 32-token prompt), and the aggregate tokens/s of 8 concurrent streams;
then how many words of one greedy completion the group writes as one process does, and
where a group's decode step goes (its step less one process's, per all-reduce it makes a
token; beside it the lone all-reduce's round trip the group timed at start, from
/health). The ratio is group / one process:
on one machine whose one GPU (or CPU) every rank shares, a group can only lose (it adds
collectives and the control channel to the same compute); across GPUs or hosts it
splits the compute, and the ratio says what that buys.

`--fits-across` is the case a group exists for: a model that one GPU cannot hold and the
group's GPUs can. The memory gate admits a process at its weights × --memory-factor plus
its --kv-budget against its GPU's free memory, and a group's ranks each at their share of
the weights plus a KV budget of their own against their own GPU (supervisor/memory/
gate.py). The bench reads each GPU's free memory as the supervisor does and picks the KV
budget halfway between the two: one process's need exceeds one GPU, each rank's share
fits. It prints the one process's refusal (its 507) and the group's decode and streams.
Without CUDA GPUs (the CPU, for the decision alone) the servers read a memory file
(`--memory-probe`) giving each rank a "GPU" of the model's weights plus 32 MiB.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu import SHAPES, build, default_dtype, server_many, server_stream
from bench.report import gpu_clocks, in_turn, paired_ratio, print_table, ratio_verdict
from bench.serverproc import ServerProcess
from protocol.models import need_bytes, weights_bytes
from supervisor.memory.probe import DeviceProbe
from supervisor.workers import blas

MEMORY_FACTOR = 1.2  # passed to both servers: the bench's arithmetic is the gate's


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


def greedy_text(server: ServerProcess, model: str, tokens: int) -> str:
    """A greedy completion of a fixed prompt: the group must write what one process
    writes."""
    body = {"model": model, "prompt": [100 + i for i in range(32)], "max_tokens": tokens,
            "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return json.loads(resp.read())["choices"][0]["text"]


def group_info(server: ServerProcess) -> dict:
    """The group's Ready.group as /health reports it (size, backend, sharding, the link's
    latency and bandwidth measured at start)."""
    _, body = server.get("/health")
    return next(w["group"] for w in body.get("workers", []) if w.get("group"))


def run_shape(shape: str, dtype: str, ranks: int, backend: str, sharding: str, rounds: int,
              tokens: int, streams: int, kv_budget: str) -> list:
    model = str(build(shape, dtype))
    common = ["--kv-budget", kv_budget, "--prompt-cache-bytes", "0", "--max-batch-size",
              str(max(8, streams))]
    results: dict[str, list] = {"one": [], "group": []}
    with tempfile.TemporaryDirectory(prefix="mlxd-multihost-") as tmp:
        hosts = hostfile(Path(tmp), ranks, backend)
        with ServerProcess([model], *common) as one, \
                ServerProcess([model], "--hosts", str(hosts), "--sharding", sharding,
                              *common) as group:
            one.wait_healthy(600)
            group.wait_healthy(300)
            print(f"{shape}: both servers ready", file=sys.stderr, flush=True)
            info = group_info(group)
            texts = [greedy_text(one, model, tokens), greedy_text(group, model, tokens)]
            servers = {"one": one, "group": group}
            for r in range(rounds + 1):  # the order alternates (bench/report.py)
                got = in_turn(r, {n: lambda _, s=s: measure(s, model, tokens, streams, r)
                                  for n, s in servers.items()})
                clocks = gpu_clocks()
                print(f"{shape} round {r}: {got}{f' [{clocks}]' if clocks else ''}",
                      file=sys.stderr, flush=True)
                if r:  # round 0 compiles
                    for name in results:
                        results[name].append(got[name])
    rows = []

    def row(label, key, unit):
        one = [m[key] for m in results["one"]]
        grp = [m[key] for m in results["group"]]
        rows.append((f"{shape} {label}",
                     f"1 process {statistics.median(one):.4g} {unit}, "
                     f"{ranks} ranks {statistics.median(grp):.4g}",
                     ratio_verdict(paired_ratio(one, grp), "<=" if unit == "s" else ">=", 1.0)))

    row("single-stream decode", "decode", "tok/s")
    row("single-stream TTFT", "ttft", "s")
    row(f"{streams} streams", "many", "tok/s")
    same = len(os.path.commonprefix(texts))
    rows.append((f"{shape} same greedy text", f"{same} of {len(texts[0])} characters alike",
                 "PASS" if texts[0] == texts[1] else "MISS"))
    # Where a group's decode step goes: tensor sharding sums partial results twice per
    # layer (attention's output and the MLP's down projection: mlx-lm's model.shard), a
    # pipeline passes its activations on once per rank boundary. The group's step less
    # one process's, spread over those all-reduces, is what each costs inside a step (with
    # the lockstep's share; a pipeline's ranks also build their halves of the graph at
    # once, so its difference can be negative); the lone all-reduce timed at start (an
    # evaluation's round trip, `latency_s`) is beside it, not a term of it.
    layers = SHAPES[shape]["num_hidden_layers"]
    reduces = 2 * layers if info["sharding"] == "tensor" else ranks - 1
    step = 1 / statistics.median(m["decode"] for m in results["group"])
    alone = 1 / statistics.median(m["decode"] for m in results["one"])
    extra = step - alone
    rows.append((f"{shape} decode step breakdown",
                 f"{step * 1e3:.2f} ms/token against {alone * 1e3:.2f}: {extra * 1e3:+.2f} ms "
                 f"over {reduces} all-reduces = {extra / reduces * 1e6:+.0f} us each",
                 f"a lone one {info['latency_s'] * 1e6:.0f} us; link "
                 f"{info['bandwidth_bytes_s'] / 1e9:.1f} GB/s, {info['backend']}"))
    return rows


def split_budget(weights: int, free: int, ranks: int) -> int:
    """The KV budget for `--fits-across`: one process's need (weights x factor + budget)
    is over `free` by half the weights' share that the group spreads, and each rank's
    (its share + budget) under it by as much."""
    held = int(weights * MEMORY_FACTOR)
    return int(free - held / ranks - held * (1 - 1 / ranks) / 2)


def fits_across(shape: str, dtype: str, ranks: int, backend: str, sharding: str, rounds: int,
                tokens: int, streams: int) -> list:
    """One process is refused for memory; the group of `ranks` serves the model."""
    model = str(build(shape, dtype))
    weights = weights_bytes(Path(model))
    reading = DeviceProbe()()
    with tempfile.TemporaryDirectory(prefix="mlxd-multihost-") as tmp:
        extra = []
        gpus = list(reading.gpus[:ranks])
        if len(gpus) < ranks:  # no GPU per rank: stand-in GPUs from a memory file
            gpus = [int(weights * MEMORY_FACTOR) + (32 << 20)] * ranks
            probe = Path(tmp) / "memory.json"
            probe.write_text(json.dumps({"available_bytes": gpus[0], "gpus": gpus}))
            extra = ["--memory-probe", str(probe)]
        free = min(gpus)
        kv = split_budget(weights, free, ranks)
        if kv <= 0:
            raise SystemExit(f"{shape}: {size(weights)} of weights leave no KV budget on "
                             f"GPUs of {size(free)} free: take a smaller shape")
        common = ["--kv-budget", str(kv), "--memory-factor", str(MEMORY_FACTOR),
                  "--memory-wait", "0", "--prompt-cache-bytes", "0",
                  "--max-batch-size", str(max(8, streams)), *extra]
        one_need = need_bytes(Path(model), MEMORY_FACTOR, kv)
        rank_need = need_bytes(Path(model), MEMORY_FACTOR, kv, (1, ranks))
        rows = [(f"{shape} memory", f"weights {size(weights)}, KV budget {size(kv)}, each "
                 f"GPU {size(free)} free",
                 "stand-in GPUs (memory file)" if extra else f"{len(gpus)} CUDA GPUs")]
        with ServerProcess([model], *common) as one:
            reason = settled(one)
            status, answer = post(one, model, [100 + i for i in range(32)], 8)
        refused = status != 200
        rows.append((f"{shape} one process", f"needs {size(one_need)}: "
                     + (f"{reason[:100]}" if refused else "served"),
                     "refused (as it must)" if refused else "NOT refused"))
        hosts = hostfile(Path(tmp), ranks, backend)
        with ServerProcess([model], "--hosts", str(hosts), "--sharding", sharding,
                           *common) as group:
            group.wait_healthy(600)
            status, answer = post(group, model, [100 + i for i in range(32)], 8)
            if status != 200:
                rows.append((f"{shape} {ranks} ranks", f"each needs {size(rank_need)}: "
                             f"{status} {answer[:90]}", "NOT served"))
                return rows
            got = []
            for r in range(rounds + 1):
                m = measure(group, model, tokens, streams, r)
                print(f"{shape} fits-across round {r}: {m}", file=sys.stderr, flush=True)
                if r:  # round 0 compiles
                    got.append(m)
        rows.append((f"{shape} {ranks} ranks", f"each needs {size(rank_need)}: "
                     f"decode {statistics.median(m['decode'] for m in got):.4g} tok/s, "
                     f"{streams} streams {statistics.median(m['many'] for m in got):.4g} "
                     f"tok/s", "served" + ("" if refused else " (but so was one process)")))
    return rows


def size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def settled(server: ServerProcess, timeout: float = 600) -> str:
    """Wait until the server's start-up load of its model is over: "" once loaded, else
    why it was refused (/health's reason)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            code, body = server.get("/health", timeout=2)
            if body.get("status") == "ok":
                return ""
            if "refused" in body.get("reason", ""):
                refusal = body["reason"].split("last refused: ")[-1]  # "MODEL: why; ..."
                return refusal.split(": ", 1)[-1].split(";")[0]
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the model neither loaded nor was refused in {timeout} s")


def post(server: ServerProcess, model: str, prompt: list[int], tokens: int) -> tuple[int, str]:
    """(status, the error's message or the text) of a greedy /v1/completions."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    if resp.status == 200:
        return 200, data["choices"][0]["text"]
    return resp.status, str(data.get("error", {}).get("message", data))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--sharding", default="tensor", choices=("tensor", "pipeline"))
    p.add_argument("--backend", default="ring", help="ring (ranks may share a device) or "
                   "nccl (one CUDA GPU per rank)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-budget", default=None)
    p.add_argument("--fits-across", action="store_true",
                   help="a model one GPU cannot hold, served by the group (see above)")
    args = p.parse_args()

    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    dtype = default_dtype(args.dtype)
    backend = args.backend
    info = mx.device_info()
    rows = []
    for shape in args.shapes.split(","):
        if args.fits_across:
            rows += fits_across(shape, dtype, args.ranks, backend, args.sharding,
                                args.rounds, args.tokens, args.streams)
            continue
        rows += run_shape(shape, dtype, args.ranks, backend, args.sharding, args.rounds,
                          args.tokens, args.streams,
                          args.kv_budget or ("24G" if gpu else "2G"))
    what = "a model only the group holds" if args.fits_across else "one process"
    print_table(f"worker group ({args.ranks} ranks, {args.sharding}, {backend}) vs {what}: "
                f"{info.get('device_name', info.get('architecture', 'cpu'))} "
                f"(MLX {mx.__version__}, {dtype}, {args.rounds} rounds, {args.tokens} "
                f"tokens)", rows)


if __name__ == "__main__":
    blas.reexec()
    main()
