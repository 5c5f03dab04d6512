"""`mlxctl`: administer mlxd.

    mlxctl status                      workers: state, memory, load, tokens/s; memory free
    mlxctl models                      local MLX models with sizes, and which are loaded
    mlxctl swap MODEL [--drain|--force] [--replace OLD]...
    mlxctl load MODEL | unload MODEL [--drain|--force]
    mlxctl kill [MODEL] [--no-restart] hard-cancel everything on a worker (all without MODEL)
    mlxctl cache ls | save NAME | drop NAME | clear [MODEL]
                                       KV snapshots of conversations (memory and disk)
    mlxctl pull MODEL [--revision R] [--gguf FILE]
                                       download from Hugging Face into the local cache:
                                       a bar per file and overall, resumable
    mlxctl rm MODEL                    delete a model from that cache (refused while loaded)
    mlxctl run MODEL [PROMPT]          chat in the terminal (one answer with PROMPT or stdin)
    mlxctl top                         a live view of workers, queues, batches, tokens/s
    mlxctl ui                          open the dashboard in the browser, with the token
    mlxctl logs [-f] [-n LINES]        the server's log
    mlxctl service install [MLXD FLAGS] | uninstall | start | stop | status
    mlxctl serve [MLXD FLAGS]          run the server in the foreground (same as `mlxd`)

The server is found through --url or MLXD_URL (default http://127.0.0.1:8080); the admin
token is read from the state directory (--state-dir, MLXD_STATE_DIR, or the platform's
place, as for mlxd). Human tables by default, --json for scripts.
Exit codes: 0 ok, 1 the server answered with an error or is not healthy, 2 usage error,
3 the server is not running (or not reachable), 4 refused (admin token missing or wrong),
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mlxctl import chat, pull, top, ui
from mlxctl.connection import (  # noqa: F401  (the names scripts and tests import)
    DEFAULT_URL, EXIT_DOWN, EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, EXIT_UNHEALTHY, EXIT_USAGE, HEALTHY,
    Client, Failed, Refused, ServerDown, emit)
from mlxctl.format import format_cache, format_models, format_status
from mlxctl.pull import Hub
from supervisor.config import default_log_dir, resolve


@dataclass
class Deps:
    """What tests replace: the hub a pull talks to, the service manager's command runner,
    the browser `mlxctl ui` opens."""
    hub: Hub = field(default_factory=Hub)
    service_runner: Callable | None = None
    open_browser: Callable[[str], bool] | None = None
    home: Path | None = None
    platform: str = sys.platform


# ---- commands --------------------------------------------------------------------------

def cmd_status(args, client: Client, deps: Deps) -> int:
    body = client.call("GET", "/admin/status", timeout=10)
    emit(args, body, format_status(body))
    return EXIT_OK if body.get("status") in HEALTHY else EXIT_UNHEALTHY


def cmd_models(args, client: Client, deps: Deps) -> int:
    try:
        body = client.call("GET", "/admin/models", timeout=30)
    except ServerDown:  # the files are here whether or not the server runs
        from supervisor.memory import catalog
        body = {"models": [{**m.to_dict(), "state": "not_loaded"}
                           for m in catalog.scan(client.state_dir)]}
    emit(args, body, format_models(body))
    return EXIT_OK


def cmd_swap(args, client: Client, deps: Deps) -> int:
    body = client.call("POST", "/admin/swap", {"model": args.model, "mode": args.mode,
                                               "replace": args.replace or None})
    replaced = ", ".join(body["replaced"]) or "nothing"
    emit(args, body, f"swapped to {body['model']} ({body['mode']}) in {body['seconds']:.2f} s; "
                     f"unloaded: {replaced}")
    return EXIT_OK


def cmd_load(args, client: Client, deps: Deps) -> int:
    body = client.call("POST", "/admin/load", {"model": args.model})
    emit(args, body, f"{body['model']}: {body['state']} (context {body['context_length']})")
    return EXIT_OK


def cmd_unload(args, client: Client, deps: Deps) -> int:
    body = client.call("POST", "/admin/unload", {"model": args.model, "mode": args.mode})
    emit(args, body, f"{body['model']}: unloaded")
    return EXIT_OK


def cmd_kill(args, client: Client, deps: Deps) -> int:
    req = {"restart": not args.no_restart}
    if args.model:
        req["model"] = args.model
    body = client.call("POST", "/admin/kill", req)
    lines = [f"{k['model']}: killed, {k['cancelled']} request(s) cancelled, "
             + ("restarting" if k["restarted"] else "not restarted") for k in body["killed"]]
    emit(args, body, "\n".join(lines))
    return EXIT_OK


def cmd_cache(args, client: Client, deps: Deps) -> int:
    """KV snapshots: ls [--model M] | save NAME | drop NAME | clear [MODEL]."""
    if args.action == "ls":
        query = f"?model={urllib.parse.quote(args.model)}" if args.model else ""
        body = client.call("GET", "/admin/cache" + query, timeout=30)
        emit(args, body, format_cache(body, time.time()))
        return EXIT_OK
    req = {}
    if args.action == "clear":
        model = args.model or args.name
    else:
        if not args.name:
            print(f"mlxctl: cache {args.action} needs a snapshot name (see `mlxctl cache ls`)",
                  file=sys.stderr)
            return EXIT_USAGE
        req["name"], model = args.name, args.model
    if model:
        req["model"] = model
    body = client.call("POST", f"/admin/cache/{args.action}", req, timeout=30)
    emit(args, body, "\n".join(f"{r['model']}: {r['message']}" for r in body["results"]))
    return EXIT_OK if all(r["ok"] for r in body["results"]) else EXIT_UNHEALTHY


def _log_file(args, client: Client) -> Path:
    """The running server's log file, or where a server with this state dir logs."""
    try:
        return Path(client.call("GET", "/admin/status", timeout=3)["server"]["log_file"])
    except (ServerDown, Refused, Failed, KeyError):
        explicit = args.state_dir is not None or client.state_dir_explicit
        return default_log_dir(client.state_dir, explicit) / "mlxd.log"


def tail(path: Path, n: int) -> tuple[list[str], int]:
    """The last `n` lines and the offset after them."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-n:] if n > 0 else [], len(data)


def follow(path: Path, offset: int, *, poll_s: float = 0.25, out=sys.stdout) -> None:
    """Print what is appended, reopening the file when the logger rotates it."""
    f = open(path, "rb")
    f.seek(offset)
    try:
        while True:
            chunk = f.read()
            if chunk:
                out.write(chunk.decode("utf-8", "replace"))
                out.flush()
                continue
            time.sleep(poll_s)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell():
                f.close()
                f = open(path, "rb")
    finally:
        f.close()


def cmd_logs(args, client: Client, deps: Deps) -> int:
    path = _log_file(args, client)
    try:
        lines, offset = tail(path, args.lines)
    except FileNotFoundError:
        print(f"mlxctl: no log at {path} yet", file=sys.stderr)
        return EXIT_UNHEALTHY
    for line in lines:
        print(line)
    sys.stdout.flush()
    if args.follow:
        try:
            follow(path, offset)
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def cmd_service(args, client: Client, deps: Deps) -> int:
    from mlxctl.service import Service, ServiceError, run_command, spec_for

    svc = Service(platform=deps.platform, home=deps.home,
                  run=deps.service_runner or run_command)
    try:
        if args.action == "install":
            spec = spec_for(args.mlxd_flags, home=deps.home, platform=deps.platform)
            path = svc.install(spec)
            emit(args, {"installed": str(path), "program": spec.program},
                 f"installed {path}\nrunning: {' '.join(spec.program)}\nlogs: {spec.log_dir}")
        elif args.action == "uninstall":
            emit(args, {"uninstalled": str(svc.uninstall())}, f"uninstalled {svc.path}")
        elif args.action in ("start", "stop"):
            getattr(svc, args.action)()
            emit(args, {args.action: True}, f"mlxd service: {args.action} ok")
        else:
            running, detail = svc.status()
            emit(args, {"installed": svc.path.exists(), "running": running, "path": str(svc.path),
                        "detail": detail}, detail)
            return EXIT_OK if running else EXIT_UNHEALTHY
    except ServiceError as e:
        print(f"mlxctl: {e}", file=sys.stderr)
        return EXIT_UNHEALTHY
    return EXIT_OK


# ---- arguments -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("MLXD_URL", DEFAULT_URL))
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the server's state directory, where the admin token is [MLXD_STATE_DIR]")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the server (swaps and loads take a while)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_):
        sp = sub.add_parser(name, parents=[common], help=help_)
        sp.set_defaults(func=func)
        return sp

    def mode(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--drain", dest="mode", action="store_const", const="drain",
                       help="finish running requests first (default)")
        g.add_argument("--force", dest="mode", action="store_const", const="force",
                       help="cancel running requests and kill the worker")
        sp.set_defaults(mode="drain")

    add("status", cmd_status, "workers, memory and load")
    add("models", cmd_models, "local MLX models with sizes")
    sp = add("swap", cmd_swap, "load MODEL, then unload the others")
    sp.add_argument("model")
    sp.add_argument("--replace", action="append", metavar="MODEL",
                    help="unload only this model (repeatable; default: every other one)")
    mode(sp)
    add("load", cmd_load, "load MODEL and keep it loaded").add_argument("model")
    sp = add("unload", cmd_unload, "unload MODEL")
    sp.add_argument("model")
    mode(sp)
    sp = add("kill", cmd_kill, "hard-cancel everything on a worker and kill it")
    sp.add_argument("model", nargs="?")
    sp.add_argument("--no-restart", action="store_true", help="leave it unloaded")
    sp = add("cache", cmd_cache, "KV snapshots: ls | save NAME | drop NAME | clear [MODEL]")
    sp.add_argument("action", choices=["ls", "save", "drop", "clear"])
    sp.add_argument("name", nargs="?", help="a snapshot's name (a response id, or key:KEY); "
                    "for clear, the model")
    sp.add_argument("--model", default=None, help="only this loaded model")
    pull.add_parsers(add)
    sp = add("logs", cmd_logs, "print the server's log")
    sp.add_argument("-f", "--follow", action="store_true")
    sp.add_argument("-n", "--lines", type=int, default=50)
    sp = add("service", cmd_service, "run mlxd as a launchd agent / systemd user service")
    sp.add_argument("action", choices=["install", "uninstall", "start", "stop", "status"])
    sp.set_defaults(mlxd_flags=[])
    sub.add_parser("serve", help="run the server in the foreground (flags as mlxd)")
    chat.add_parser(add)
    top.add_parser(add)
    ui.add_parser(add)
    return p


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`serve ...` and `service install ...`: what follows belongs to mlxd."""
    for i, word in enumerate(argv):
        if not word.startswith("-") and (i == 0 or argv[i - 1] not in ("--url", "--state-dir",
                                                                      "--timeout")):
            if word == "serve":
                return argv[:i + 1], argv[i + 1:]
            if word == "service" and argv[i + 1:i + 2] == ["install"]:
                return argv[:i + 2], argv[i + 2:]
            return argv, None
    return argv, None


def main(argv: list[str] | None = None, deps: Deps | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    deps = deps or Deps()
    argv, passthrough = _split_passthrough(argv)
    if passthrough is not None and argv[-1] == "serve":
        from supervisor.cli import main as serve_main
        serve_main(passthrough)
        return EXIT_OK
    args = build_parser().parse_args(argv)
    if passthrough is not None:
        flags = [f for f in passthrough if f != "--json"]
        args.json = args.json or len(flags) != len(passthrough)
        args.mlxd_flags = flags
    # The server's own resolution (flag > MLXD_STATE_DIR > config file > default), so
    # mlxctl finds the token where a server started the same way keeps it.
    resolved = resolve({}, os.environ)
    state_dir = args.state_dir or resolved.config.state_dir
    client = Client(args.url, Path(state_dir).expanduser(), args.timeout,
                    state_dir_explicit=resolved.sources["state_dir"] != "default")
    try:
        return args.func(args, client, deps)
    except ServerDown as e:
        print(f"mlxctl: {e}", file=sys.stderr)
        return EXIT_DOWN
    except Refused as e:
        print(f"mlxctl: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except Failed as e:
        if getattr(args, "json", False):
            print(json.dumps(e.body, indent=2))
        print(f"mlxctl: {e} (HTTP {e.status})", file=sys.stderr)
        return EXIT_UNHEALTHY


def run() -> None:
    """Console-script entry: exit with main()'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
