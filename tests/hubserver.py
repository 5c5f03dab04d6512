"""A local server that speaks enough of the Hugging Face file API for huggingface_hub's
`model_info(files_metadata=True)` and `hf_hub_download` (point `HF_ENDPOINT` at it):
`mlxctl pull` tested with nothing leaving the machine.

    GET  /api/models/{org}/{name}[/revision/{rev}]   the repo's commit and files (sizes)
    HEAD /{org}/{name}/resolve/{rev}/{file}          X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{file}          the bytes; `Range: bytes=N-` → 206
    GET  /cdn/{sha256}                               an LFS file's bytes (see `lfs`)

Files named in `lfs` are answered as the Hub answers LFS files: a 302 to a CDN on
another origin (`localhost` instead of `127.0.0.1`: same server, different origin, as
far as a client can tell), with `X-Linked-Etag` (the SHA-256) and `X-Linked-Size`.
No xet headers are sent, so huggingface_hub takes its plain HTTP path. The server
counts the bytes it sends per file, records every Range and Authorization header, can
send slowly (`rate`, bytes/s), can cut a file's connection once after N bytes
(`cut_after`), or cut it and then answer 503 for it until told otherwise (`fail_after`).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1()
            for name in sorted(self.files):
                h.update(name.encode() + hashlib.sha256(self.files[name]).digest())
            self.commit = h.hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    rate: float | None = None                 # bytes per second per response (None: at once)
    lfs: set[str] = field(default_factory=set)                # files served through the CDN
    cut_after: dict[str, int] = field(default_factory=dict)   # file -> cut once after N bytes
    fail_after: dict[str, int] = field(default_factory=dict)  # file -> cut, then 503s
    served: dict[str, int] = field(default_factory=dict)      # file -> bytes sent
    ranges: list[tuple[str, str]] = field(default_factory=list)   # (file, Range header)
    auth: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Authorization)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _broken: set[str] = field(default_factory=set)

    def mend(self) -> None:
        """The files `fail_after` broke are served again (the network is back)."""
        with self.lock:
            self.fail_after.clear()
            self._broken.clear()

    def offsets(self, name: str) -> list[int]:
        """Where each ranged GET of `name` asked to start."""
        return [int(r.split("=")[1].split("-")[0]) for f, r in self.ranges if f == name]


def etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub

    def log_message(self, *args):  # quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        # huggingface_hub maps X-Error-Code to its errors (RepoNotFound, EntryNotFound).
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._quietly(self._route)

    def do_HEAD(self):
        self._quietly(self._route)

    def _quietly(self, route) -> None:
        try:
            with self.hub.lock:
                self.hub.auth.append((self.path, self.headers.get("Authorization")))
            route()
        except (BrokenPipeError, ConnectionResetError):   # the client went: as it may
            pass

    def _route(self) -> None:
        path = self.path.split("?", 1)[0]
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo = self.hub.repos.get(m.group(1))
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            return self._json(200, {
                "id": m.group(1), "modelId": m.group(1), "sha": repo.commit, "private": False,
                "siblings": [{"rfilename": n, "size": len(d), "blobId": git_oid(d)}
                             for n, d in sorted(repo.files.items())]})
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
        if m:
            for repo in self.hub.repos.values():
                for name, data in repo.files.items():
                    if etag(data) == m.group(1):
                        return self._file(repo, name)
            return self._error(404, "EntryNotFound", "no such object")
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m or m.group(1) not in self.hub.repos:
            return self._error(404, "RepoNotFound", "Repository not found")
        repo = self.hub.repos[m.group(1)]
        name = m.group(3)
        if name not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found")
        if name in self.hub.lfs:
            return self._redirect(repo, name)
        self._file(repo, name)

    def _redirect(self, repo: Repo, name: str) -> None:
        data = repo.files[name]
        host, port = self.server.server_address[:2]
        assert host == "127.0.0.1"
        self.send_response(302)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{git_oid(data)}"')     # the pointer file's
        self.send_header("X-Linked-Etag", f'"{etag(data)}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Location", f"http://localhost:{port}/cdn/{etag(data)}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _file(self, repo: Repo, name: str) -> None:
        data = repo.files[name]
        start = 0
        rng = self.headers.get("Range")
        if self.command == "GET":
            with self.hub.lock:
                if rng:
                    self.hub.ranges.append((name, rng))
                if name in self.hub._broken:
                    return self._error(503, "ServiceUnavailable", "try again later")
        if rng and self.command == "GET":
            start = int(re.fullmatch(r"bytes=(\d+)-(\d*)", rng).group(1))
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{etag(data)}"')
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub.lock:
            cut = self.hub.cut_after.pop(name, None)
            if name in self.hub.fail_after:
                cut = self.hub.fail_after[name]
                self.hub._broken.add(name)
        sent, step = 0, 16 << 10
        while sent < len(body):
            chunk = body[sent:sent + step]
            if cut is not None and start + sent + len(chunk) > cut:
                chunk = chunk[:max(0, cut - start - sent)]
                self.wfile.write(chunk)
                self.wfile.flush()
                self._count(name, len(chunk))
                self.close_connection = True
                self.connection.shutdown(2)   # the download breaks here
                return
            self.wfile.write(chunk)
            self._count(name, len(chunk))
            sent += len(chunk)
            if self.hub.rate:
                time.sleep(len(chunk) / self.hub.rate)

    def _count(self, name: str, n: int) -> None:
        with self.hub.lock:
            self.hub.served[name] = self.hub.served.get(name, 0) + n


class HubServer:
    """`with HubServer(hub) as url:` a running fake hub at `url`."""

    def __init__(self, hub: Hub):
        handler = type("BoundHandler", (Handler,), {"hub": hub})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
