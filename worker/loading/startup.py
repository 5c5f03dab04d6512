"""What a worker process builds before it serves, shared by the one-process worker
(worker/__main__.py) and each rank of a worker group (worker/group/rank.py): the batch
within its KV budget, MLX's buffer cache within what the memory gate admitted, and
Metal's wired memory."""

from __future__ import annotations

import logging

log = logging.getLogger("worker")

# Prefill chunks grow from --prefill-step up to this (mlx-lm's own default) while steps are
# fast (worker/loop/batch.py ChunkSizer).
PREFILL_LARGEST = 2048


def make_batch(engine, args, path, shard: str = "", cls=None):
    """The batch the scheduler runs, its KV within --kv-budget: the context is capped to
    what the budget holds for one sequence, so that one always fits alone. With a prompt
    cache, named KV snapshots too (on disk under STATE_DIR/kv/MODEL-IDENTITY; a group's
    ranks, each with its own shard of every state, under MODEL-IDENTITY-`shard`). `cls`:
    the batch's class (a vision-language model's: worker/vision/batch.py)."""
    from worker.loop.batch import Batch
    from worker.loop.sizing import ChunkSizer, StepMemory
    from worker.errors import LoadError

    kv_format = kv_format_of(engine, args)
    kv = kv_size(engine.model, args.max_kv_size, kv_format)
    mtp_head = None
    if args.speculative == "mtp" and not shard:  # (worker/speculative/mtp.py)
        from worker.loading.mtp_head import load_head

        mtp_head = load_head(engine.model, path)
        mtp_head.count_in(kv, args.max_draft_tokens)  # (each sequence's head cache)
    fits = kv.tokens_within(args.kv_budget)
    if fits < 2:
        raise LoadError(f"--kv-budget {args.kv_budget} bytes holds no sequence of this model "
                        f"({kv.of(2)} bytes for two tokens)")
    if fits < engine.context_length:
        log.warning("context capped at %d tokens (the model's is %d): that is what "
                    "--kv-budget (%d bytes) holds for one sequence", fits,
                    engine.context_length, args.kv_budget)
        engine.cap_context(fits)
    kvcache = _kvcache(engine, args, path, shard, kv_format) \
        if args.prompt_cache_bytes > 0 else None
    # (a chat's system prompt: a state worth keeping where the cache cannot be trimmed)
    engine.keeps_system = kvcache is not None and not kvcache.trimmable
    step = max(1, args.prefill_step)
    draft, price = None, None
    if getattr(args, "draft_model", None):
        from worker.loading.draft import load_draft
        if args.max_draft_tokens and args.max_kv_size is None and cls is None and not shard:
            price = measured_price(engine.model, args.max_draft_tokens)  # (its rule's too)
        draft = load_draft(args.draft_model, args, engine,
                           "text" if cls is None and not shard else "vision or group",
                           target_per_token=kv.per_token, verify=price)
    Batch = cls or Batch
    batch = Batch(engine, max_size=max(1, args.max_batch_size), prefill_step=step,
                 prefill_batch=max(1, args.prefill_batch_size), kv_budget=args.kv_budget,
                 kvcache=kvcache, kv=kv, max_kv_size=args.max_kv_size, kv_format=kv_format,
                 chunks=ChunkSizer(step, max(PREFILL_LARGEST, step)),
                 # (Not in a worker group yet: its ranks step together, and
                 # a verification step is not one the followers know.)
                 speculative=args.speculative, max_draft=0 if shard else args.max_draft_tokens,
                 mtp_head=mtp_head,
                 draft=draft,
                 spare=device_spare(),
                 # (Not a group's rank: each would measure its own shard, and every rank
                 # must run the chunk the leader chose: worker/group/follower.py.)
                 step_memory=None if shard else StepMemory.measure(
                     engine.model, engine.vocab_size or 0, kv_format=kv_format,
                     rows=max(1, args.max_batch_size)))
    if draft is not None and (mtp_head is not None or batch.speculation is None):
        raise LoadError("--draft-model cannot draft with --speculative mtp, --max-kv-size, "
                        "--max-draft-tokens 0 or a model with sliding-window layers")
    if mtp_head is not None and batch.speculation is None:
        raise LoadError("--speculative mtp cannot draft with --max-kv-size, --max-draft-tokens "
                        "0 or a model with sliding-window layers (their caches are not rolled "
                        "back yet)")
    price_verification(batch, engine, price)
    return batch


def measured_price(model, longest: int):
    """What a verification must earn on this device (worker/speculative/cost.py
    `verify_price`); None where it cannot be timed (a timing that fails never stops a
    load: the fixed price then, with a warning)."""
    from worker.speculative.adaptive import MIN_GAIN
    from worker.speculative.cost import verify_price

    try:
        price = verify_price(model, longest)
    except Exception as e:
        log.warning("could not time a verification step (%s: %s); drafts are priced at "
                    "the fixed %.1f tokens", type(e).__name__, e, MIN_GAIN)
        return None
    if price is not None:
        log.info("a verification must earn %.2f tokens (a draft of 1) to %.2f (of %d) on this "
                 "device, or the sequence rests from drafting", price[0], price[1], longest)
    return price


def price_verification(batch, engine, price=None) -> None:
    """The batch's verifications priced on this device (`measured_price`, or `price`
    where it was measured already, for the draft model's rule), once it speculates at
    all."""
    if batch.speculation is None:
        return
    if price is None:
        price = measured_price(engine.model, batch.max_draft)
    batch.speculation.verify_price = price


# Of the device's free memory, what a prefill chunk leaves free however much it borrows:
# this share of the device, for other processes and the memory gate's next load.
SPARE_MARGIN = 0.1


def device_spare():
    """What a prefill chunk's working memory may borrow beyond the KV budget, read before
    each chunk that needs it (worker/loop/batch.py `_fit_chunk`): the device's free memory
    and this process's buffer cache, less SPARE_MARGIN of the device. Only where MLX reads
    the device's free memory (CUDA); None elsewhere (the budget alone bounds a chunk).
    Why: a chunk's activations last one step, and within the default --kv-budget (1 GiB)
    alone a cold 2,000-token prompt on the 0.5B shape went through in small chunks, each
    a forward pass to launch: 110 ms to its first token on an H100 against 21 with
    --kv-budget 24G (issue 36)."""
    import mlx.core as mx

    info = mx.device_info()
    total = info.get("total_memory") or info.get("memory_size") or 0
    if "free_memory" not in info or not total:
        return None
    margin = int(total * SPARE_MARGIN)

    def spare() -> int:
        return max(0, int(mx.device_info()["free_memory"]) + mx.get_cache_memory() - margin)

    return spare


def kv_format_of(engine, args):
    """The KV format of --kv-bits and --kv-group-size, checked against the model: a
    LoadError naming what cannot work (worker/kvcache/quantized.py), never silently full
    precision."""
    from worker.errors import LoadError
    from worker.kvcache.quantized import FormatError, KVFormat

    kv_format = KVFormat.of(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
    try:
        model_type = getattr(getattr(engine.model, "args", None), "model_type", "")
        kv_format.check(engine.model, args.max_kv_size, model_type)
    except FormatError as e:
        raise LoadError(str(e)) from None
    return kv_format


def kv_size(model, window, kv_format):
    """What a sequence's KV takes. With --quantized-kv-start N its first N tokens may be
    held at full precision: the quantized bytes per token, plus what N tokens take more at
    full precision (a bound for every length)."""
    from worker.loop.sizing import KVSize

    kv = KVSize.measure(model, window, kv_format.from_the_first if kv_format.quantized
                        else kv_format)
    if not kv_format.start:
        return kv
    plain = KVSize.measure(model, window)
    return KVSize(kv.per_token, int(kv.per_sequence + (plain.per_token - kv.per_token)
                                    * kv_format.start), window, kv.windows)


def _kvcache(engine, args, path, shard: str = "", kv_format=None):
    """The KV cache manager: the prompt-prefix cache within --prompt-cache-bytes (and the
    KV budget), and the disk tier of named snapshots within --kv-disk-bytes."""
    from worker.kvcache.disk import DiskTier
    from worker.kvcache.identity import model_identity, snapshot_dir
    from worker.kvcache.manager import KVCache, trimmable
    from worker.kvcache.prefix import PrefixCache

    prefix = PrefixCache(min(args.prompt_cache_bytes, args.kv_budget), args.prompt_cache_ttl)
    disk = None
    if args.kv_disk_bytes > 0:
        identity = model_identity(path, args.max_kv_size, kv_format.tag if kv_format else "") \
            + (f"-{shard}" if shard else "")
        disk = DiskTier(snapshot_dir(args.state_dir, identity), args.kv_disk_bytes)
        disk.start()
    return KVCache(prefix, disk, trimmable=trimmable(engine.model, args.max_kv_size))


def set_wired_limit() -> None:
    """Metal only: keep the weights wired (as mlx-lm does while generating)."""
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            from mlx_lm.utils import maybe_set_recommended_wired_limit

            maybe_set_recommended_wired_limit()
    except Exception:  # an optimisation; never a reason to fail a load
        log.warning("could not set the wired memory limit", exc_info=True)


def cache_limit(admitted: int, resident: int, kv_budget: int, floor: int = 0) -> int:
    """MLX's buffer cache may hold what the admitted size leaves once the resident
    memory (the weights, as loaded) and the KV budget (the batch's KV, its transients and
    the prompt cache: worker/loop/batch.py) are counted, and never less than `floor`:
    what one decode step at the batch's full width frees (worker/loop/sizing.py
    `StepMemory.freed`), nor more than the admitted size less the resident memory.

    Why the floor: MLX returns a freed buffer to the system when the cache is at its
    limit (its allocators: the CPU's frees it, CUDA's cudaFreeAsync-s it), and the next
    step allocates it again. The leftover is near 0 for a small model or a memory factor
    near 1 (the tiny model's was 0 bytes: on the CPU a malloc counter saw a step's large
    allocations go from 6 to 0 with the floor); a 0.5B's at the default factor is already
    ~190 MiB against a 16 MB step, and there neither the floor nor a 3 x cache changed
    its decode rate on an H200 (docs/benchmarks.md, session 7).
    Why it still fits what the gate admitted: those buffers are a step's transients, which
    the KV budget already counts at the batch's full width (`StepMemory.decode`, at least
    the measured freed bytes). While a step runs they are live and come out of the cache,
    which is then empty of them; between steps they sit in the cache and are not live. So
    live memory plus the cache stays within the weights, the KV budget and the leftover;
    only a floor above the leftover may hold buffers of another kind (a prefill chunk's)
    instead, and the cap keeps even that within the admitted size."""
    return min(max(floor, admitted - resident - kv_budget), max(0, admitted - resident))


def bound_memory(path, args, batch) -> int:
    """Keep the process within what the memory gate admitted it at (protocol/models.py
    `need_bytes`, from the same settings): MLX keeps freed buffers for reuse, up to a
    cache limit that by default is the device's whole memory limit (on a Mac, 1.5 x the
    recommended working set), memory the user's other programs then do not have. Call
    once loaded and warmed, before anything is cached; `batch`: the engine's (None for an
    engine without one: its activations are then what the cache serves), whose KV budget
    is what it may hold beyond the weights and whose decode step at full width is the
    floor (`cache_limit`; none where the step was not measured: a group's rank, a serial
    batch). Returns the limit set."""
    import mlx.core as mx

    from protocol.models import need_bytes

    kv_budget = getattr(batch, "kv_budget", 0)
    step = getattr(batch, "step_memory", None)
    floor = step.decode(batch.max_size) if step is not None else 0

    admitted = need_bytes(path, args.memory_factor, args.kv_budget)
    resident = mx.get_active_memory()
    limit = cache_limit(admitted, resident, kv_budget, floor)
    mx.set_cache_limit(limit)
    mx.clear_cache()
    room = getattr(batch, "cache_room", None)
    if room is not None:
        room.limit, room.need = limit, floor
    log.info("MLX buffer cache limited to %.1f MiB (%d bytes): the admitted %.1f MiB less "
             "%.1f MiB resident and the %.1f MiB KV budget, at least a decode step's "
             "%d bytes at %d rows", limit / 2**20, limit, admitted / 2**20,
             resident / 2**20, kv_budget / 2**20, floor, getattr(batch, "max_size", 0))
    return limit
