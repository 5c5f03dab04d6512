"""`python -m worker.group.launch`: the process the supervisor spawns for a worker group.

It starts the ranks with `mlx.launch` (which writes the backend's hostfile, sets each
rank's MLX_RANK, and reaches other hosts over ssh) and stays as their parent, for four
things `mlx.launch` does not do for a supervisor:
- beat while the ranks start: the leader's link cannot beat before the group is joined
  (`mx.distributed.init` holds the GIL while it waits for every rank: a thread beside it
  stalls as long), and on a loaded machine starting every rank's interpreter and joining
  takes longer than any heartbeat timeout. So this process sends heartbeats ("loading")
  on the worker's events socket from its start until the leader's link beats (the leader
  creates the file $MLXD_GROUP_LINK_UP: worker/group/rank.py), then stops: from then on
  silence from the leader, or from any rank through it, kills the group as for any worker;
- die with the supervisor: a lifeline watches the supervisor and kills this process group
  (the local ranks and `mlx.launch`; remote ranks lose their ssh session);
- report why the group ended: `mlx.launch` exits 0 whatever its ranks did, so the leader
  writes its exit code to a file (worker/group/rank.py) and this process exits with it;
- keep `mlx.launch` from spinning: it forwards its stdin to every rank, and its loop
  selects on each rank's stdin pipe, which is writable, so the loop never sleeps (a
  core burnt for nothing). Its stdin gets newlines enough to fill the ranks' pipes
  (which nothing reads); a full pipe is not writable, and the loop waits again.

Ports: a group whose hosts are all this machine (tests, several GPUs of one host) gets
free ones; otherwise the hostfile's `starting_port` for the ring backend (default
mlx.launch's 32323) and `control_port` for the leader's control channel (default 32320
and the next; worker/group/control.py), both mlxd keys mlx.launch ignores. The control
channel is bound to the first host's first address, never to every interface.

A SIGTERM here does nothing by itself: the supervisor stops a group with a Shutdown to
the leader, which stops every rank, and kills the process group if that takes too long.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import zmq

from protocol import encode, sockets
from protocol.messages import LOAD_FAILED, Error
from protocol.exits import EXIT_LOAD_FAILED
from protocol.hosts import is_local, rank_devices, read_hostfile
from protocol.settings import worker_parser
from worker import lifeline
from worker.group import keys
from worker.group.rank import (BACKEND_ENV, CONTROL_ENV, DEVICES_ENV, EXIT_FILE_ENV, KEYS_ENV,
                               LINK_UP_ENV, cause_file)
from worker.status import WorkerStatus

log = logging.getLogger("worker.group.launch")

EXIT_NO_CODE = 1   # the leader left no code (killed before it could write one)
FILL = b"\n" * (1 << 18)   # more than any OS's pipe buffer (64 KiB on Linux and macOS)


EPHEMERAL_FROM = 49152   # where the OS's ephemeral ports start: IANA's, macOS's default
LOCAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")   # Linux's own


def ephemeral_from(path: Path = LOCAL_RANGE) -> int:
    """The first port this machine gives outgoing connections (Linux says, in
    ip_local_port_range; elsewhere IANA's 49152, macOS's default)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_FROM


def free_ports(count: int, first: int = 20000, last: int | None = None) -> int:
    """The first of `count` consecutive ports free on this machine now, below the
    ephemeral range by default: a rank binds its port seconds after this choice (once
    its interpreter has started, longer on a loaded machine), and any connection this
    machine opens meanwhile may take an ephemeral port as its own end."""
    import random

    last = last or max(first + 1000, ephemeral_from())
    for _ in range(100):
        base = random.randrange(first, last - count)
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free range of ports for the ring backend")


def backend_of(data: dict) -> str:
    if data.get("backend"):
        return str(data["backend"])
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() else "ring"  # mlx.launch's own default


def link_up_file(exit_file: str) -> Path:
    """The file the leader creates once its link beats (beside the exit file)."""
    return Path(exit_file + ".up")


def launch_command(hostfile: Path, data: dict, exit_file: str, worker: list[str],
                   key_folder: Path) -> list:
    backend = backend_of(data)
    hosts = data["hosts"]
    if all(is_local(h) for h in hosts):
        ring = sum(max(1, len(h.get("ips", []))) for h in hosts)
        # One draw for the ring's ports and the control channel's two after them: two
        # draws could overlap (nothing binds a drawn port until the ranks start).
        port = free_ports(ring + 2)
        control = f"tcp://127.0.0.1:{port + ring}"
    else:
        port = int(data.get("starting_port", 32323))
        ips = hosts[0].get("ips") or [hosts[0]["ssh"]]
        control = f"tcp://{ips[0]}:{int(data.get('control_port', 32320))}"
    script = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    launcher = [script] if script else [
        sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; "
                              "sys.exit(main())"]
    envs = [f"{EXIT_FILE_ENV}={exit_file}", f"{BACKEND_ENV}={backend}",
            f"{CONTROL_ENV}={control}", f"{KEYS_ENV}={key_folder}",
            f"{LINK_UP_ENV}={link_up_file(exit_file)}"]
    if backend == "nccl":  # a GPU per rank (rank.pin_device); ring ranks may share one
        envs.append(f"{DEVICES_ENV}="
                    + ",".join(rank_devices(hosts, os.environ.get("CUDA_VISIBLE_DEVICES"))))
    return [*launcher, "--hostfile", str(hostfile), "--backend", backend,
            "--starting-port", str(port), *(a for e in envs for a in ("--env", e)),
            "--", *worker]


def beat_until_up(worker: list[str], link_up: Path, done: threading.Event) -> int:
    """Heartbeats ("loading") on the events socket of the rank command `worker`, with its
    epoch, every --heartbeat-interval, until `link_up` exists (the leader's link beats
    now) or `done` is set (mlx.launch ended). Returns how many were sent."""
    opts, _ = worker_parser().parse_known_args(worker)
    status = WorkerStatus(opts.epoch)
    ctx = zmq.Context()
    sock = sockets.push(ctx, opts.events, bind=False)
    sent = 0
    try:
        while not link_up.exists():
            sock.send(encode(status.heartbeat()))
            sent += 1
            if done.wait(opts.heartbeat_interval):
                break
    finally:
        sock.close()
        ctx.term()
    return sent


def _fill(fd: int) -> None:
    """Write FILL to mlx.launch's stdin and keep it open (EOF would make it readable,
    and its loop would spin on that instead)."""
    try:
        view = memoryview(FILL)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass  # mlx.launch is gone


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.group.launch", description=__doc__)
    p.add_argument("--hostfile", required=True, type=Path)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--exit-file", required=True)
    p.add_argument("--state-dir", required=True, type=Path, help="where the group's keys are")
    p.add_argument("worker", nargs=argparse.REMAINDER, help="-- the rank's command")
    args = p.parse_args(argv)
    worker = args.worker[1:] if args.worker[:1] == ["--"] else args.worker
    logging.basicConfig(level=logging.INFO, format="launch[%(process)d] %(message)s")

    def die() -> None:  # the supervisor is gone: so is everything this process started
        os.killpg(os.getpgrp(), signal.SIGKILL)

    # A polling lifeline (not PDEATHSIG): its `die` must run here, in this process.
    lifeline.install(args.parent_pid, platform="poll", die=die)
    signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: the leader stops the group"))
    link_up = link_up_file(args.exit_file)
    link_up.unlink(missing_ok=True)
    cause_file(args.exit_file).unlink(missing_ok=True)
    done = threading.Event()
    beats = threading.Thread(target=beat_until_up, args=(worker, link_up, done), name="beat",
                             daemon=True)
    beats.start()  # first: what follows may import MLX (backend_of), slow when loaded
    try:
        try:
            data = read_hostfile(args.hostfile)
            cmd = launch_command(args.hostfile, data, args.exit_file, worker,
                                 keys.ensure(args.state_dir))
        except (ValueError, RuntimeError, OSError) as e:
            log.error("%s", e)
            return EXIT_LOAD_FAILED  # nothing was started
        stdin, feed = os.pipe()
        proc = subprocess.Popen(cmd, stdin=stdin)
        os.close(stdin)
        threading.Thread(target=_fill, args=(feed,), name="fill", daemon=True).start()
        proc.wait()
    finally:
        done.set()
        beats.join(5.0)
        link_up.unlink(missing_ok=True)
    try:
        code = int(Path(args.exit_file).read_text().strip())
        os.unlink(args.exit_file)
    except (OSError, ValueError):
        code = EXIT_NO_CODE
    report_cause(worker, cause_file(args.exit_file))
    return code


def report_cause(worker: list[str], cause: Path) -> bool:
    """Send the cause a rank left before the group was joined (rank.fail_before_join) as
    the load's Error on the events socket of the rank command `worker`: the supervisor
    then marks the model broken with that reason and answers its requests with a
    retryable 503 naming it. True if there was one."""
    try:
        message = cause.read_text().strip()
        cause.unlink()
    except OSError:
        return False
    opts, _ = worker_parser().parse_known_args(worker)
    ctx = zmq.Context()
    sock = sockets.push(ctx, opts.events, bind=False, linger_ms=2000)
    try:
        sock.send(encode(Error(epoch=opts.epoch, code=LOAD_FAILED, message=message)))
    finally:
        sock.close()
        ctx.term()
    return True


if __name__ == "__main__":
    sys.exit(main())
