"""Joining the group and loading this rank's shard.

Every function here is collective: every rank calls it, in the same order (the worker's
startup, worker/group/rank.py). A decision every rank must share (the seed, whether the
hosts have the memory) is made from figures every rank has (gathered), or taken by rank 0
and broadcast, never from what one rank alone saw.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import time
from pathlib import Path

import mlx.core as mx
import msgpack

from protocol import models as shared
from protocol.messages import GroupInfo, GroupRank, ModelKind
from worker.loading import models
from worker.text import sampling
from worker.group import p2p
from worker.group.broadcast import Broadcast
from worker.loading.models import LoadedModel
from worker.errors import LoadError

log = logging.getLogger("worker.group.setup")

_PROBE_BYTES = 4 << 20     # the bandwidth probe's all-reduce
_PROBE_ROUNDS = 20         # latency: tiny all-reduces timed


def join():
    """This process's group, from what `mlx.launch` put in the environment (which backend:
    ring, JACCL, MPI or NCCL). Strict: a rank that cannot reach the others fails here."""
    return mx.distributed.init(strict=True)


def channel(group) -> Broadcast:
    """The control channel, on the stream the model's own collectives run on (mlx-lm's
    generation stream). Collectives of two streams may run in either order (each stream
    has its own thread), and the ranks would pair one rank's broadcast with another's
    layer sum; on one stream they run in the order they were issued, on every rank."""
    from mlx_lm.generate import generation_stream

    return Broadcast(group, stream=generation_stream)


def share_seed(chan: Broadcast) -> int:
    """One random seed for every rank (rank 0's): unseeded sampling, and the reseeding
    after a failed step, then pick the same tokens everywhere."""
    mine = struct.pack("<Q", random.SystemRandom().getrandbits(63)) if chan.rank == 0 else None
    (seed,) = struct.unpack("<Q", chan.exchange(mine))
    mx.random.seed(seed)
    rng = random.Random(seed)
    sampling.use_seed_source(lambda: rng.getrandbits(64))
    return seed


def free_bytes() -> int:
    """Memory this host can still give a model: the GPU's free memory on CUDA, else what
    the OS says is available (unified memory on Apple Silicon)."""
    if mx.cuda.is_available():
        info = mx.device_info()
        free = info.get("free_memory") or info.get("total_memory") or info.get("memory_size")
        if free:
            return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(chan: Broadcast, need: int) -> list[dict]:
    """Every rank's host, device, free memory and need, gathered; raises LoadError on EVERY
    rank (the same verdict from the same figures) when some host or GPU cannot hold the
    ranks it runs. Before any weight is read: a group loads only where every one passes."""
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "") if mx.cuda.is_available() else None
    mine = {"host": socket.gethostname(), "device": device, "free": free_bytes(),
            "need": int(need), "pid": os.getpid()}
    rows = [msgpack.unpackb(r) for r in chan.gather(msgpack.packb(mine))]
    problem = memory_problem(rows)
    if problem is not None:
        raise LoadError(problem)
    return rows


def memory_problem(rows: list[dict]) -> str | None:
    """Why the ranks' memory cannot hold the group (None: it can). Ranks on one memory
    (a host's RAM, unified memory, or one GPU) add up their needs against the least free
    any of them saw; ranks on GPUs of their own (CUDA, each rank's device its own:
    worker/group/rank.py pin_device) are judged each against its own GPU, so a model
    larger than one GPU fits a host whose GPUs together hold it."""
    pools: dict[tuple, list] = {}
    for r in rows:
        pools.setdefault((r["host"], r.get("device")), []).append(r)
    gib = 1 << 30
    for (host, device), ranks in pools.items():
        need_here = sum(r["need"] for r in ranks)
        free_here = min(r["free"] for r in ranks)
        if need_here > free_here:
            where = f"host {host}" + (f" GPU {device}" if device not in (None, "") else "")
            return (f"{where} cannot hold its {len(ranks)} rank(s) of the group: they need "
                    f"about {need_here / gib:.1f} GiB and {free_here / gib:.1f} GiB is "
                    f"available")
    return None


def rank_need(path: Path, size: int, memory_factor: float, kv_budget: int) -> int:
    """What one rank takes: its share of the weights (times the gate's factor) plus its
    KV budget."""
    return shared.need_bytes(path, memory_factor, kv_budget, (1, max(1, size)))


def load_shard(path: Path, config: dict, chan: Broadcast, sharding: str):
    """This rank's shard of the model at `path`, by mlx-lm's own sharding: tensor parallel
    (`model.shard`: attention heads and MLP columns split, partial sums all-reduced) or
    pipeline parallel (`model.model.pipeline`: consecutive layers per rank). Returns
    (model, tokenizer, the sharding used). The weights load lazily, so each rank reads
    only its shard. (mlx-lm's `sharded_load` does the same, but downloads through the
    hub and pipelines only checkpoints with an index file.)"""
    from mlx_lm.utils import load_model, load_tokenizer

    group = chan.group
    model, _ = load_model(path, lazy=True, strict=False)
    chosen = _sharding(model, config, group.size(), sharding, prefer=preferred())
    if chosen == "tensor":
        model.shard(group)
    else:
        if not native_p2p():
            p2p.install()
        model.model.pipeline(group)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path, {"trust_remote_code": True},
                               eos_token_ids=config.get("eos_token_id"))
    chan.exchange(b"loaded" if chan.rank == 0 else None)  # every rank has its shard
    return model, tokenizer, chosen


P2P_ENV = "MLXD_GROUP_P2P"


def native_p2p() -> bool:
    """Whether MLX's backend here has send/recv, which mlx-lm's pipeline passes activations
    with: not its CUDA backend (0.32: "Recv has no CUDA implementation"), where p2p.py
    carries them by all-reduces. MLXD_GROUP_P2P=collectives uses those anywhere (tests
    run them on CPU ranks)."""
    if os.environ.get(P2P_ENV) == "collectives":
        return False
    return not (mx.default_device() == mx.gpu and mx.cuda.is_available())


def preferred() -> str:
    """What `auto` picks where the model allows both: pipeline on a CUDA GPU, tensor
    elsewhere. On 2 x H200 over NCCL (session 6, a 7B in bench.multihost) tensor parallel
    decoded at 0.40 x one process, its 56 all-reduces a token (~150 us each) over half the
    step, while pipeline decoded at 1.46 x with one transfer a token; on Macs, tensor
    parallel is what mlx-lm's distributed examples run over Thunderbolt."""
    return "pipeline" if mx.default_device() == mx.gpu and mx.cuda.is_available() else "tensor"


def _sharding(model, config: dict, size: int, wanted: str, prefer: str = "tensor") -> str:
    """The sharding to use: `wanted`, or for auto `prefer` where it is possible, else
    the other."""
    tensor_ok = hasattr(model, "shard")
    pipeline_ok = hasattr(model, "model") and hasattr(model.model, "pipeline")
    layers = shared.config_value(config, ("num_hidden_layers", "n_layer")) or 0
    heads = shared.config_value(config, ("num_key_value_heads",)) or \
        shared.config_value(config, ("num_attention_heads",)) or 0
    kind = config.get("model_type", "this model")
    # Why each way is out, so a refusal names the reasons of the way asked for (a llama
    # asked for pipeline has none: its heads are no reason).
    why = {"tensor": [], "pipeline": []}
    if not tensor_ok:
        why["tensor"].append(f"mlx-lm's {kind} has no tensor parallel sharding")
    elif heads % size:
        tensor_ok = False
        why["tensor"].append(f"its {heads} key/value heads do not split over {size} ranks")
    if not pipeline_ok:
        why["pipeline"].append(f"mlx-lm's {kind} has no pipeline parallel sharding")
    elif layers < size:
        pipeline_ok = False
        why["pipeline"].append(f"its {layers} layers are fewer than {size} ranks")
    if wanted == "tensor" and tensor_ok or wanted == "pipeline" and pipeline_ok:
        return wanted
    if wanted == "auto" and (tensor_ok or pipeline_ok):
        ok = {"tensor": tensor_ok, "pipeline": pipeline_ok}
        return prefer if ok[prefer] else next(way for way in ok if ok[way])
    detail = "; ".join(why.get(wanted) or why["tensor"] + why["pipeline"])
    raise LoadError(f"cannot shard the model over {size} ranks ({wanted}): {detail}")


def load(args, group, chan: Broadcast, progress=None) -> tuple[LoadedModel, str, list]:
    """Resolve MODEL (converting a GGUF once per host), check every host's memory, load
    this rank's shard. Returns (the loaded model, the sharding used, each rank's row)."""
    path = models.resolve(args.model, args.state_dir, models.gguf_options(args), progress)
    config = models.read_config(path)
    kind = shared.model_kind(path, config)
    if kind is not ModelKind.TEXT:
        raise LoadError(f"a worker group serves text models; {args.model} is a {kind} model")
    rows = check_memory(chan, rank_need(path, group.size(), args.memory_factor, args.kv_budget))
    try:
        model, tokenizer, chosen = load_shard(path, config, chan, args.sharding)
    except LoadError:
        raise
    except Exception as e:
        log.exception("loading the shard of %s failed", path)
        raise LoadError(f"could not load this rank's shard of {args.model}: "
                        f"{type(e).__name__}: {e}"[:500]) from None
    from worker.demos.text import is_random_weights

    loaded = LoadedModel(model=model, tokenizer=tokenizer, path=path,
                         context_length=models.context_length(config, args.max_context_tokens),
                         vocab_size=shared.config_value(config, ("vocab_size",)),
                         random_weights=is_random_weights(path), kind=kind)
    return loaded, chosen, rows


def probe_link(chan: Broadcast) -> tuple[float, float]:
    """The link as the group's collectives see it: (seconds per tiny all-reduce, bytes per
    second of a 4 MiB one). Run at start; `mlxctl status` shows it."""
    small = mx.zeros((1,), dtype=mx.float32)
    chan.all_sum(small)   # (connections warm)
    t = time.perf_counter()
    for _ in range(_PROBE_ROUNDS):
        chan.all_sum(small)
    latency = (time.perf_counter() - t) / _PROBE_ROUNDS
    big = mx.zeros((_PROBE_BYTES // 4,), dtype=mx.float32)
    chan.all_sum(big)
    t = time.perf_counter()
    for _ in range(3):
        chan.all_sum(big)
    bandwidth = 3 * _PROBE_BYTES / max(1e-9, time.perf_counter() - t)
    return latency, bandwidth


def describe(chan: Broadcast, rows: list, backend: str, sharding: str, latency: float,
             bandwidth: float) -> GroupInfo:
    """What Ready says of the group: every rank's host, pid and MLX memory after loading
    (gathered now), the sharding and the link."""
    mine = msgpack.packb({"active": mx.get_active_memory(), "peak": mx.get_peak_memory()})
    after = [msgpack.unpackb(r) for r in chan.gather(mine)]
    ranks = [GroupRank(rank=i, host=row["host"], pid=row["pid"], free_bytes=row["free"],
                       active_bytes=a["active"], peak_bytes=a["peak"])
             for i, (row, a) in enumerate(zip(rows, after))]
    return GroupInfo(size=chan.group.size(), backend=backend, sharding=sharding, ranks=ranks,
                     latency_s=latency, bandwidth_bytes_s=bandwidth)
