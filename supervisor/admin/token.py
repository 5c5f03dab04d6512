"""The admin token: a secret in the state directory (mode 0600) that `/admin/*` requires.

The server creates it on start if it is missing; `mlxctl` reads it from the same state
directory. Whoever can read the file is the machine's user, which is who may administer
the server; the loopback-only rule keeps other machines out even with the token.
Stdlib only: mlxctl imports this.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE = "admin-token"


def token_path(state_dir: Path) -> Path:
    return Path(state_dir) / TOKEN_FILE


def read_token(state_dir: Path) -> str | None:
    return read_secret(token_path(state_dir))


def read_secret(path: Path) -> str | None:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):  # missing, unreadable or not text: no usable token
        return None
    return token or None


def ensure_token(state_dir: Path) -> str:
    return ensure_secret(token_path(state_dir))


def ensure_secret(path: Path) -> str:
    """The secret in `path` (the admin token; the Responses compaction key), created
    (0600, atomically: never readable by others, never half written) if missing, empty
    or not text. An existing file's mode is tightened to 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = read_secret(path)
    if token is not None:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return token
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)  # whatever the umask did
    os.replace(tmp, path)
    return token
