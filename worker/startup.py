"""What a worker process builds before it serves, shared by the one-process worker
(worker/__main__.py) and each rank of a worker group (worker/group/rank.py): the batch
within its KV budget, and Metal's wired memory."""

from __future__ import annotations

import logging

log = logging.getLogger("worker")

# Prefill chunks grow from --prefill-step up to this (mlx-lm's own default) while steps are
# fast (worker/batch.py ChunkSizer).
PREFILL_LARGEST = 2048


def make_batch(engine, args, path, shard: str = ""):
    """The batch the scheduler runs, its KV within --kv-budget: the context is capped to
    what the budget holds for one sequence, so that one always fits alone. With a prompt
    cache, named KV snapshots too (on disk under STATE_DIR/kv/MODEL-IDENTITY; a group's
    ranks, each with its own shard of every state, under MODEL-IDENTITY-`shard`)."""
    from worker.batch import Batch, ChunkSizer, KVSize
    from worker.models import LoadError
    from worker.prefix_cache import PrefixCache

    if args.kv_bits is not None:
        raise LoadError("--kv-bits: a quantized KV cache cannot combine with continuous "
                        "batching yet (mlx-lm's BatchGenerator has no quantized batch cache); "
                        "leave --kv-bits unset")
    kv = KVSize.measure(engine.model, args.max_kv_size)
    fits = kv.tokens_within(args.kv_budget)
    if fits < 2:
        raise LoadError(f"--kv-budget {args.kv_budget} bytes holds no sequence of this model "
                        f"({kv.of(2)} bytes for two tokens)")
    if fits < engine.context_length:
        log.warning("context capped at %d tokens (the model's is %d): that is what "
                    "--kv-budget (%d bytes) holds for one sequence", fits,
                    engine.context_length, args.kv_budget)
        engine.cap_context(fits)
    prefix = snapshots = None
    if args.prompt_cache_bytes > 0:
        prefix = PrefixCache(min(args.prompt_cache_bytes, args.kv_budget), args.prompt_cache_ttl)
        snapshots = _snapshots(prefix, args, path, shard)
    step = max(1, args.prefill_step)
    return Batch(engine, max_size=max(1, args.max_batch_size), prefill_step=step,
                 prefill_batch=max(1, args.prefill_batch_size), kv_budget=args.kv_budget,
                 prefix=prefix, kv=kv, max_kv_size=args.max_kv_size,
                 chunks=ChunkSizer(step, max(PREFILL_LARGEST, step)), snapshots=snapshots)


def _snapshots(prefix, args, path, shard: str = ""):
    from worker.snapshots.disk import DiskTier
    from worker.snapshots.identity import model_identity, snapshot_dir
    from worker.snapshots.store import SnapshotStore

    disk = None
    if args.kv_disk_bytes > 0:
        identity = model_identity(path, args.max_kv_size) + (f"-{shard}" if shard else "")
        disk = DiskTier(snapshot_dir(args.state_dir, identity), args.kv_disk_bytes)
        disk.start()
    return SnapshotStore(prefix, disk)


def set_wired_limit() -> None:
    """Metal only: keep the weights wired (as mlx-lm does while generating)."""
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            from mlx_lm.utils import maybe_set_recommended_wired_limit

            maybe_set_recommended_wired_limit()
    except Exception:  # an optimisation; never a reason to fail a load
        log.warning("could not set the wired memory limit", exc_info=True)
