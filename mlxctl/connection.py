"""mlxctl's connection to the server: the admin client, its errors, exit codes, output.

Every command module (mlxctl/*.py) builds on this one; `client.py` holds the
parser and the commands that are one call each. Stdlib only: mlxctl must start fast and
run where only the standard library is.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.admin.token import read_token, token_path

DEFAULT_URL = "http://127.0.0.1:8080"
EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE, EXIT_DOWN, EXIT_REFUSED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130   # Ctrl-C, as shells report it
HEALTHY = ("ok", "idle")


class ServerDown(Exception):
    pass


class Refused(Exception):
    pass


class Failed(Exception):
    """The server answered with an error envelope."""

    def __init__(self, status: int, body: dict):
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        super().__init__(msg or f"HTTP {status}")
        self.status, self.body = status, body


@dataclass
class Client:
    url: str
    state_dir: Path
    timeout: float = 600.0
    token: str | None = field(default=None, init=False)
    state_dir_explicit: bool = False   # set by config, not the platform's default

    def __post_init__(self):
        self.token = read_token(self.state_dir)

    def call(self, method: str, path: str, body: dict | None = None,
             timeout: float | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url.rstrip("/") + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            try:
                payload = json.load(e)
            except ValueError:
                payload = {}
            if e.code in (401, 403):
                raise Refused(self._refusal(e.code, payload)) from None
            raise Failed(e.code, payload) from None
        except (urllib.error.URLError, OSError) as e:
            raise ServerDown(f"mlxd is not running at {self.url} ({getattr(e, 'reason', e)}); "
                             "start it with `mlxctl serve --model MODEL` or "
                             "`mlxctl service start`") from None

    def _refusal(self, code: int, payload: dict) -> str:
        msg = (payload.get("error") or {}).get("message", f"HTTP {code}")
        if code == 403:
            return f"the server refused: {msg}"
        where = token_path(self.state_dir)
        if self.token is None:
            return (f"no admin token at {where}: is the server using another state "
                    "directory? (pass --state-dir or set MLXD_STATE_DIR)")
        return f"the server refused the admin token from {where}: {msg}"


def emit(args, body: dict, text: str) -> None:
    print(json.dumps(body, indent=2) if args.json else text)
