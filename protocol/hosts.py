"""A worker group's hostfile (mlx.launch's JSON format), as both processes read it: the
supervisor (its memory gate counts this host's share of the model; a bad file stops
`mlxd` at start) and the group's launcher (worker/group/launch.py). No MLX, no aiohttp.

    [{"ssh": NAME, "ips": [...]}, ...]    or
    {"hosts": [...], "backend": "ring", "envs": [...], "starting_port": N, "control_port": N}

(`starting_port` and `control_port` are mlxd's keys; mlx.launch ignores them.)
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

LOCAL = {"127.0.0.1", "localhost", "::1"}


def read_hostfile(path: Path) -> dict:
    """The hostfile as {"hosts": [...], ...}, checked for what mlxd needs of it: two hosts
    or more, each with an ssh name, the first this machine (its rank speaks to the
    supervisor). Raises ValueError saying what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the hostfile {path}: {e}") from None
    if isinstance(data, list):
        data = {"hosts": data}
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, list) or len(hosts) < 2 or not all(
            isinstance(h, dict) and isinstance(h.get("ssh"), str) for h in hosts):
        raise ValueError(f"the hostfile {path} must list at least two hosts, each "
                         '{"ssh": NAME, "ips": [...]}')
    if not is_local(hosts[0]):
        raise ValueError(f"the hostfile {path}: its first host must be this machine (its "
                         "rank speaks to this supervisor)")
    return data


def is_local(host: dict) -> bool:
    names = {host["ssh"], *host.get("ips", [])}
    return bool(names & (LOCAL | {socket.gethostname()}))


def local_share(data: dict) -> tuple[int, int]:
    """(ranks on this machine, ranks in all)."""
    hosts = data["hosts"]
    return sum(1 for h in hosts if is_local(h)), len(hosts)


def rank_devices(hosts: list[dict], visible: str | None = None) -> list[str]:
    """Each rank's GPU (for CUDA_VISIBLE_DEVICES), by rank: its place among its own
    host's entries, so the ranks of one host each get their own GPU, whatever the
    hostfile's order. mlx.launch's own choice is `rank % --repeat-hosts`, and with a
    hostfile --repeat-hosts is 1: every rank on GPU 0 (NCCL then fails, "invalid usage",
    on duplicate devices). `visible`: this machine's CUDA_VISIBLE_DEVICES, which the
    places index for the ranks on this machine (other hosts' are their own)."""
    seen: dict[str, int] = {}
    mine = [d.strip() for d in visible.split(",")] if visible else []
    devices = []
    for h in hosts:
        local = is_local(h)
        host = "" if local else h["ssh"]  # this machine, however each entry names it
        place = seen[host] = seen.get(host, -1) + 1
        devices.append(mine[place] if local and place < len(mine) else str(place))
    return devices
