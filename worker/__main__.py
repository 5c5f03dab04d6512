"""`python -m worker`: one process per loaded model, driven over ZeroMQ by the supervisor.

Order matters:
1. the lifeline first, so even a worker stuck in a long load dies with its supervisor;
2. sockets and I/O threads next, so heartbeats (state "loading") flow during the load;
3. load and warm up the model, send Ready;
4. the scheduler loop on the MAIN thread, which owns MLX until Shutdown or SIGTERM.

Exit codes: 0 after a cooperative shutdown, 3 when the model could not be loaded, 4 when a
failed request left MLX unable to run a step (the scheduler's WorkerBroken): the
supervisor starts a fresh worker and re-queues what this one never started.
Logs go to stderr (the supervisor keeps its tail to explain a death) and never contain
prompt or generated text unless --log-prompts. Each line is capped (`LogLineCap`): the
supervisor reads stderr line by line, and an exception that echoes a client's input (a
schema, a prompt) must not become a line of megabytes.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

from protocol.exits import EXIT_BROKEN, EXIT_LOAD_FAILED
from protocol.settings import worker_parser
from worker.loading.startup import bound_memory, set_wired_limit

LOG_LINE_LIMIT = 2000  # characters


log = logging.getLogger("worker")


def parse_args(argv=None) -> argparse.Namespace:
    """The worker's flags: the same settings table, names and defaults as `mlxd`'s
    (protocol/settings.py), plus the per-process ones (sockets, epoch, parent)."""
    return worker_parser(description=__doc__.splitlines()[0]).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from worker import lifeline

    lifeline.install(args.parent_pid)
    # No timestamp: the supervisor logs each stderr line with its own.
    handler = logging.StreamHandler(sys.stderr)
    who = f"%(process)d r{os.environ.get('MLX_RANK', '?')}" if args.group else "%(process)d"
    handler.setFormatter(LogLineCap(f"worker[{who}] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # `kill -USR1 <pid>` dumps every thread's stack to stderr: how a hang gets explained.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.group:  # one rank of a worker group (worker/group/)
        from worker.group.rank import pin_device, serve

        pin_device()  # before anything imports MLX
        return serve(args)

    import zmq

    from protocol.messages import (LOAD_FAILED, Done, Error, FinishReason, Generate, Ready,
                                   Shutdown)
    from worker.errors import LoadError, WorkerBroken
    from worker.loading import models
    from worker.link import Link
    from worker.status import WorkerStatus

    status = WorkerStatus(args.epoch)
    ctx = zmq.Context()
    link = Link(ctx, args.commands, args.events, status, args.heartbeat_interval)
    name = args.name or args.model

    loading = [True]  # a cell the signal handler can read and clear

    def answer_queued(reason: FinishReason) -> None:
        """Every Generate gets one Done, also those that arrived while we were loading."""
        while not link.commands.empty():
            cmd = link.commands.get_nowait()
            if isinstance(cmd, Generate):
                link.send(Done(epoch=args.epoch, rid=cmd.rid, finish_reason=reason))

    def on_sigterm(signum, frame):
        # Serving: the same path as a Shutdown message (SimpleQueue.put is safe here).
        if not loading[0]:
            link.commands.put(Shutdown())
            return
        # Loading: a load cannot look at the queue, and an exception raised into it may
        # be swallowed or rewritten by library code (an import turns it into an
        # ImportError). So finish right here: answer, flush the events, and leave.
        loading[0] = False
        log.info("terminated while loading")
        answer_queued(FinishReason.CANCELLED)
        link.close()
        logging.shutdown()
        os._exit(0)

    # The handler goes in before the link starts: its threads answer status requests
    # ("loading") from the moment they run, and a SIGTERM sent on that word must find it,
    # or the default action kills the process with its queue unanswered. Blocking SIGTERM
    # until here is no substitute: a process-directed signal goes to any thread that does
    # not block it, and threads started before main() (the preloaded OpenBLAS's pool on
    # Linux, supervisor/workers/blas.py) never blocked it.
    signal.signal(signal.SIGTERM, on_sigterm)
    link.start()

    try:
        from worker.loading.kinds import KINDS  # its rows import MLX: a failure is a load error

        log.info("loading %s", args.model)
        def progress(done: int, total: int) -> None:  # heartbeats carry it (mlxctl status)
            status.load_progress = done / total if total else None

        loaded = models.load(args.model, args.state_dir, args.max_context_tokens,
                             gguf_options=models.gguf_options(args), progress=progress)
        kind = KINDS[loaded.kind]
        if args.draft_model and loaded.kind.value == "text":  # (found as MODEL is)
            args.draft_model = str(models.resolve(args.draft_model, args.state_dir,
                                                  models.gguf_options(args)))
        set_wired_limit()
        engine, batch = kind.start(loaded, args)  # warmed: the first request pays no compile
        bound_memory(loaded.path, args, batch)
        loading[0] = False
    except Exception as e:
        loading[0] = False
        if isinstance(e, LoadError):
            msg = str(e)
        else:  # not ours: the type is safe to show, the details go to stderr only
            msg = f"could not load model {args.model}: {type(e).__name__}"
            log.exception("load failed")
        log.error("load failed: %s", msg)
        link.send(Error(epoch=args.epoch, code=LOAD_FAILED, message=msg))
        answer_queued(FinishReason.ERROR)
        link.close()
        return EXIT_LOAD_FAILED

    import mlx.core as mx

    from worker.text import tokens

    slots = batch.max_size if batch is not None else 1
    log.info("ready: %s (%s, context %d, batch %d, %s)", name, loaded.kind,
             engine.context_length, slots, loaded.path)
    memory = mx.get_active_memory(), mx.get_peak_memory()
    status.publish("ready", (), (), *memory)  # no heartbeat says "loading" after Ready
    link.send(Ready(epoch=args.epoch, model=name, context_length=engine.context_length,
                    pid=os.getpid(), slots=slots, random_weights=loaded.random_weights,
                    active_bytes=memory[0], peak_bytes=memory[1],
                    vocab_size=engine.vocab_size or 0, model_kind=loaded.kind,
                    tokenizer=tokens.info(getattr(engine, "tokenizer", None)),
                    **kind.ready(engine)))
    try:
        try:
            kind.loop(engine, batch, link, status, args).run()
        finally:
            if batch is not None:
                batch.close()  # the snapshot writes queued reach the disk
    except WorkerBroken:
        # No Done for what waits here: the supervisor re-queues what never started.
        log.critical("exiting with code %d: MLX cannot run a step in this process after a "
                     "failed request; the supervisor starts a fresh worker", EXIT_BROKEN)
        link.close()
        return EXIT_BROKEN
    log.info("shutting down")
    link.close()
    return 0


class LogLineCap(logging.Formatter):
    """Each line of a record (tracebacks included) at most LOG_LINE_LIMIT characters."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if len(text) <= LOG_LINE_LIMIT:
            return text
        return "\n".join(line if len(line) <= LOG_LINE_LIMIT
                         else f"{line[:LOG_LINE_LIMIT]}… [{len(line)} chars]"
                         for line in text.split("\n"))


if __name__ == "__main__":
    sys.exit(main())
