"""One rank of a worker group, from start to exit (`python -m worker --group`).

The same startup on every rank, in the same order, because every step of it is
collective (worker/group/setup.py): join, share the seed, check every host's memory, load
this rank's shard, build and warm the batch, probe the link. Then rank 0 (the leader)
speaks the protocol to the supervisor and runs the ordinary scheduler over a
`LeaderBatch`; the others replay its batch (worker/group/follower.py).

Exit codes are the worker's (protocol/exits.py), plus EXIT_GROUP_LOST: a collective
failed (a rank died, the link broke) or a follower diverged. The leader also writes its
code to $MLXD_GROUP_EXIT_FILE, because the process the supervisor waits on is the
launcher (`mlx.launch` exits 0 whatever its ranks did). The launcher also beats for the
group while its ranks start, until the leader's link beats (the leader creates
$MLXD_GROUP_LINK_UP: worker/group/launch.py says why). A SIGTERM reaching the leader
comes from `mlx.launch` after another rank failed: the leader leaves at once with
EXIT_GROUP_LOST (taken on a thread of its own, whatever the main thread is doing:
`leave_on_sigterm`), so its clients get a retryable error, not a "cancelled" ending. A rank
that cannot see its GPU (NCCL) leaves before joining, with the cause in a file beside the
exit file, which the launcher sends the supervisor as the load's Error.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path

log = logging.getLogger("worker.group")

EXIT_FILE_ENV = "MLXD_GROUP_EXIT_FILE"
BACKEND_ENV = "MLXD_GROUP_BACKEND"
CONTROL_ENV = "MLXD_GROUP_CONTROL"   # tcp://HOST:PORT of the leader's control channel
KEYS_ENV = "MLXD_GROUP_KEYS"         # the folder of its CURVE keys (worker/group/keys.py)
LINK_UP_ENV = "MLXD_GROUP_LINK_UP"   # a file the leader creates once its link beats
DEVICES_ENV = "MLXD_GROUP_DEVICES"   # each rank's GPU, by rank (protocol/hosts.py)


def leave(code: int) -> int:
    """Record the leader's exit code for the launcher; returns it. Written beside the file
    and renamed onto it, so the file is never seen empty or half written: another thread
    may end the process at any moment (a SIGTERM's `_Leave`, while the main thread records
    its own code), and a file truncated by `open(path, "w")` whose write never came made
    the launcher exit "with no code" (1, a plain crash) where the group had been lost."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        part = f"{path}.{threading.get_ident()}"
        try:
            with open(part, "w") as f:
                f.write(str(code))
            os.replace(part, path)
        except OSError:
            log.warning("could not write the exit file %s", path)
    return code


def leave_on_sigterm(code: int) -> None:
    """A SIGTERM ends this process at once with `code` (recorded by `leave`), whatever its
    main thread is doing.

    mlx.launch SIGTERMs the other ranks when one dies, and the leader's main thread may then
    be inside MLX's C++ for good: the ring backend fails a dead peer's pending transfers
    once and stops that socket's thread, so a collective queued after them (the rest of the
    failed step) never returns. A Python handler runs only on the main thread, between
    bytecodes: the link beat on while the dead rank's silence grew, and the supervisor
    killed the group for that silence (cause `heartbeat`), not as a group that lost a rank.
    Python's C-level handler writes the signal's number to the wakeup fd from whichever
    thread the signal interrupts: a thread of its own reads it and leaves (MLX waits with
    the GIL released). Blocking SIGTERM for `sigwait` is no substitute: a process-directed
    signal goes to any thread that does not block it, and threads started before main()
    (the preloaded OpenBLAS's pool) never did.
    """
    now = _Leave(code)

    def watch(fd: int) -> None:
        while signal.SIGTERM not in os.read(fd, 64):  # (one byte per signal caught)
            pass
        now()

    wake, woken = os.pipe()
    os.set_blocking(woken, False)  # (the C handler must never block)
    signal.signal(signal.SIGTERM, now)  # (the main thread's, when it runs: either leaves)
    signal.set_wakeup_fd(woken, warn_on_full_buffer=False)
    threading.Thread(target=watch, args=(wake,), name="sigterm", daemon=True).start()


class _Leave:
    """The SIGTERM's way out, taken once: both handlers run for one signal (Python's on the
    main thread, `watch` on its own), and the second must not write the exit file again
    while the first's exit is under way (one CI run: "terminated" logged twice, the
    launcher then found an empty file and reported a crash, not a lost group)."""

    def __init__(self, code: int):
        self.code = code
        self._once = threading.Lock()

    def __call__(self, *_) -> None:
        if not self._once.acquire(blocking=False):
            return  # the other handler is leaving: the process ends with its code
        log.error("terminated: another rank of the group failed")
        os._exit(leave(self.code))


def pin_device() -> None:
    """This rank's own GPU, before MLX is imported: mlx.launch sets CUDA_VISIBLE_DEVICES
    to `rank % --repeat-hosts`, 0 for every rank of a hostfile, after the launcher's
    --env values (so those cannot correct it). The launcher passes each rank's device
    (protocol/hosts.py `rank_devices`) for the NCCL backend, which needs one per rank."""
    devices, rank = os.environ.get(DEVICES_ENV), os.environ.get("MLX_RANK")
    if devices and rank is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.split(",")[int(rank)]


def cause_file(exit_file: str) -> Path:
    """Where a rank that fails before the group is joined writes why (beside the exit
    file): the leader's link is not up yet, so the launcher reports it (launch.py)."""
    return Path(exit_file + ".cause")


def device_problem(backend: str, cuda: bool, on_gpu: bool, rank: str | None,
                   visible: str | None, host: str) -> str | None:
    """Why this rank cannot run the NCCL backend (None: it can): NCCL needs each rank on
    a CUDA GPU of its own, and a rank whose CUDA_VISIBLE_DEVICES names no GPU of its host
    would otherwise fail inside NCCL's init with 'invalid usage' or hang there."""
    if backend != "nccl" or (cuda and on_gpu):
        return None
    return (f"rank {rank} on host {host} cannot see its GPU (CUDA_VISIBLE_DEVICES="
            f"{visible if visible is not None else '(unset)'}): the NCCL backend needs "
            f"one GPU per rank; check the hostfile's entries for that host against its GPUs")


def check_device() -> str | None:
    """`device_problem` for this process (imports MLX: after pin_device)."""
    backend = os.environ.get(BACKEND_ENV, "ring")
    if backend != "nccl":
        return None
    import mlx.core as mx

    try:
        cuda = bool(mx.cuda.is_available())
        on_gpu = cuda and mx.default_device() == mx.gpu
    except Exception:  # (a CUDA runtime that cannot start: the same verdict)
        cuda = on_gpu = False
    return device_problem(backend, cuda, on_gpu, os.environ.get("MLX_RANK"),
                          os.environ.get("CUDA_VISIBLE_DEVICES"), socket.gethostname())


def fail_before_join(problem: str) -> int:
    """Leave the group before joining it: the cause where the launcher reads it, the load
    failure's exit code for it to exit with, and the log line naming the cause."""
    log.error("load failed: %s", problem)
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        try:
            cause_file(path).write_text(problem)
        except OSError:
            log.warning("could not write %s", cause_file(path))
    from protocol.exits import EXIT_LOAD_FAILED

    return leave(EXIT_LOAD_FAILED)


def link_up() -> None:
    """The leader's link beats from now on: the launcher stops beating for the group."""
    path = os.environ.get(LINK_UP_ENV)
    if path:
        try:
            open(path, "w").close()
        except OSError:
            log.warning("could not write %s: the launcher beats on for the group", path)


def serve(args) -> int:
    import zmq

    from protocol.messages import LOAD_FAILED, Done, Error, FinishReason, Generate, Ready
    from protocol.exits import EXIT_BROKEN, EXIT_GROUP_LOST, EXIT_LOAD_FAILED
    from worker.loading.startup import make_batch, set_wired_limit
    from worker.group import keys as group_keys
    from worker.group import setup
    from worker.group.control import FollowerControl, LeaderControl
    from worker.group.follower import Diverged, Follower
    from worker.group.leader import GroupLost, LeaderBatch
    from worker.link import Link
    from worker.errors import LoadError
    from worker.status import WorkerStatus

    problem = check_device()
    if problem is not None:  # before joining: NCCL's init would fail or hang on it
        return fail_before_join(problem)
    group = setup.join()
    rank, size = group.rank(), group.size()
    chan = setup.channel(group)
    status = WorkerStatus(args.epoch)
    ctx = zmq.Context()
    link = None
    endpoint = os.environ[CONTROL_ENV]
    keys = group_keys.load(os.environ.get(KEYS_ENV) or group_keys.folder(args.state_dir))
    if rank == 0:
        link = Link(ctx, args.commands, args.events, status, args.heartbeat_interval)

        leave_on_sigterm(EXIT_GROUP_LOST)  # before the link answers (worker/__main__)
        link.start()
        link_up()
        control = LeaderControl(ctx, endpoint, size - 1, keys)
    else:
        control = FollowerControl(ctx, endpoint, rank, keys)

    def load_failed(msg: str) -> int:
        log.error("load failed: %s", msg)
        control.close()  # (its authenticator's sockets first: the context ends after them)
        if link is not None:
            link.send(Error(epoch=args.epoch, code=LOAD_FAILED, message=msg))
            while not link.commands.empty():
                cmd = link.commands.get_nowait()
                if isinstance(cmd, Generate):
                    link.send(Done(epoch=args.epoch, rid=cmd.rid,
                                   finish_reason=FinishReason.ERROR))
            link.close()
        return leave(EXIT_LOAD_FAILED) if rank == 0 else EXIT_LOAD_FAILED

    def progress(done: int, total: int) -> None:  # a GGUF's conversion: the leader's beats
        status.load_progress = done / total if total else None

    log.info("rank %d of %d: loading %s", rank, size, args.model)
    try:
        setup.share_seed(chan)
        loaded, sharding, rows = setup.load(args, group, chan, progress)
        set_wired_limit()
        from worker.text.engine import TextEngine

        engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length,
                            args.prefill_step, loaded.vocab_size)
        batch = make_batch(engine, args, loaded.path, f"{sharding}-{rank}of{size}")
        batch.warm()
        if args.warm_prompt is not None:
            from worker.kvcache.warm import pin_warm_prompt

            pin_warm_prompt(batch, args.warm_prompt, max(1, args.prefill_step))
        latency, bandwidth = setup.probe_link(chan)
        info = setup.describe(chan, rows, os.environ.get(BACKEND_ENV, "ring"), sharding,
                              latency, bandwidth)
        if rank == 0:
            try:
                control.wait_hellos(args.group_join_timeout)
            except RuntimeError as e:  # a wrong key, or a firewall: the same silence
                raise LoadError(f"{e}: check that every host has the same "
                                f"STATE_DIR/group-keys and can reach {endpoint}") from None
            status.group = control
    except LoadError as e:
        return load_failed(str(e))
    except Exception as e:  # a collective that failed: another rank is gone
        log.exception("loading the group failed")
        return load_failed(f"the worker group failed while loading ({type(e).__name__}: "
                           f"a rank exited or could not be reached; see the server log)")

    if rank != 0:
        log.info("rank %d of %d ready (%s)", rank, size, sharding)
        try:
            Follower(engine, batch, control).run()
        except Diverged as e:
            log.critical("this rank diverged from the leader: %s", e)
            return EXIT_GROUP_LOST
        except RuntimeError as e:
            log.error("the group is gone (%s)", str(e)[:200])
            return EXIT_GROUP_LOST
        finally:
            control.close()
        log.info("rank %d stopped", rank)
        return 0

    import mlx.core as mx

    from worker.loop.scheduler import Scheduler
    from worker.text import tokens

    from worker.errors import WorkerBroken

    log.info("ready: %s (group of %d, %s over %s; link %.0f us, %.2f GB/s)", args.name or
             args.model, size, sharding, info.backend, latency * 1e6, bandwidth / 1e9)
    memory = mx.get_active_memory(), mx.get_peak_memory()
    status.publish("ready", (), (), *memory)
    link.send(Ready(epoch=args.epoch, model=args.name or args.model,
                    context_length=engine.context_length, pid=os.getpid(),
                    slots=batch.max_size, random_weights=loaded.random_weights,
                    active_bytes=memory[0], peak_bytes=memory[1],
                    vocab_size=engine.vocab_size or 0, model_kind=loaded.kind, group=info,
                    tokenizer=tokens.info(engine.tokenizer)))
    from worker.faults import Faults

    leader = LeaderBatch(batch, control, faults=Faults.from_env())
    code = 0
    try:
        Scheduler(engine, link, status, leader, log_prompts=args.log_prompts,
                  stream_interval=args.stream_interval,
                  buffer_cache_idle=args.buffer_cache_idle).run()
    except GroupLost as e:
        log.critical("a rank of the group is gone (%s); the supervisor replaces the group", e)
        code = EXIT_GROUP_LOST
    except WorkerBroken:
        log.critical("exiting with code %d: MLX cannot run a step after a failed request",
                     EXIT_BROKEN)
        code = EXIT_BROKEN
    finally:
        leader.close(lost=code == EXIT_GROUP_LOST)
        control.close()
    link.close()
    return leave(code)
