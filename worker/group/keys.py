"""The CURVE keys of a worker group's control channel (worker/group/control.py).

ZeroMQ's CURVE authenticates and encrypts the channel between mlxd's own processes: the
leader is a CURVE server with its own key pair and accepts only clients holding the
group's rank key (a ZAP authenticator checks each connection); followers are clients of
that key, and know the leader's public key, so neither side talks to an impostor. The
keys are made once (ZeroMQ's own certificate files) under STATE_DIR/group-keys, a 0700
folder whose secret files are 0600. Every host of a group needs the same folder at the
same path (README: copy it once, as one copies an ssh key).

    group-keys/leader.key, leader.key_secret   the leader's pair
    group-keys/rank.key, rank.key_secret       the followers' pair
    group-keys/clients/rank.key                the public keys the leader accepts
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

FOLDER = "group-keys"


@dataclass(frozen=True)
class Keys:
    folder: Path
    leader_public: bytes
    leader_secret: bytes | None
    rank_public: bytes
    rank_secret: bytes | None

    @property
    def clients(self) -> Path:
        return self.folder / "clients"


def folder(state_dir: Path) -> Path:
    return Path(state_dir) / FOLDER


def ensure(state_dir: Path) -> Path:
    """The group's key folder, made (atomically: a race with another launcher leaves one
    complete set) if it does not exist yet."""
    target = folder(state_dir)
    if (target / "rank.key_secret").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".group-keys.", dir=target.parent))  # 0700
    try:
        zmq.auth.create_certificates(tmp, "leader")
        zmq.auth.create_certificates(tmp, "rank")
        (tmp / "clients").mkdir(mode=0o700)
        shutil.copy(tmp / "rank.key", tmp / "clients" / "rank.key")
        for f in tmp.glob("*.key_secret"):
            os.chmod(f, 0o600)
        try:
            os.rename(tmp, target)
        except OSError:  # another process made them first
            if not (target / "rank.key_secret").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(path: Path) -> Keys:
    """The keys in `path` (a folder `ensure` made, or a copy of it)."""
    path = Path(path)
    try:
        leader_public, leader_secret = zmq.auth.load_certificate(path / "leader.key_secret")
        rank_public, rank_secret = zmq.auth.load_certificate(path / "rank.key_secret")
    except (OSError, ValueError) as e:
        raise ValueError(f"the worker group's keys in {path} cannot be read ({e}); copy "
                         f"STATE_DIR/{FOLDER} from the first host to every host") from None
    return Keys(path, leader_public, leader_secret, rank_public, rank_secret)
