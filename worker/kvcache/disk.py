"""The disk tier of KV snapshots: files in the state directory, bounded by bytes.

A snapshot on disk outlives the worker: a chain of agent turns resumes after the worker
was killed or recycled, after the model was swapped out and back, after mlxd restarted.
One directory per model identity (worker/kvcache/identity.py), so a file is never read
by another model; one file per snapshot name, named by a hash of it (a client's
prompt_cache_key never becomes a path). Every file claims, under its checksum, the name
and the identity it was written for, and a file is used only where both are what its
place says (the directory's name is the identity: `snapshot_dir`): a file copied or
renamed into another's place is refused like a damaged one.

Writes happen on this tier's own thread, never on the MLX thread: `put` queues an
encoded snapshot and returns. Reads happen on the caller's thread (the preparation
thread). The tier holds at most `max_bytes` of files, least recently used out first
(used: written or read; the order survives a restart through the files' mtimes). A file
that fails to read (bad header, wrong size, checksum) is deleted and counted, never
loaded. Files are 0600 in a 0700 directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from worker.kvcache import files

log = logging.getLogger("worker.kvcache.disk")

_SUFFIX = ".safetensors"
_STOP = object()


@dataclass
class OnDisk:
    path: Path
    nbytes: int
    tokens: int
    used_at: float


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int, *, max_pending: int = 2 << 30,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(directory)
        self.identity = self.dir.name  # the model identity (snapshot_dir lays them out so)
        self.max_bytes = max_bytes
        self.max_pending = max_pending  # bytes queued for writing at most (held in memory)
        self._clock = clock
        self._lock = threading.Lock()
        self._index: OrderedDict[str, OnDisk] = OrderedDict()  # name → file, LRU first
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self.nbytes = 0
        self.evictions = self.corrupt = self.skipped = 0
        self.read_bytes = self.write_bytes = 0
        self.read_seconds = self.write_seconds = 0.0

    # ---- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Index the files already there (oldest use first) and start the writer."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write cut short (the worker was killed)
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                info = files.read_info(path)
                self._check(info, path, info.name)
            except (OSError, files.CorruptFile) as e:
                self._discard(path, e)
                continue
            found.append((path.stat().st_mtime, info, path))
        with self._lock:
            for mtime, info, path in sorted(found, key=lambda f: f[0]):
                self._index[info.name] = OnDisk(path, info.nbytes, info.tokens, mtime)
                self.nbytes += info.nbytes
            self._evict()
        self._thread = threading.Thread(target=self._writer, name="kv-disk", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Finish the writes queued (within `timeout`), then stop the writer."""
        self.flush(timeout)
        self._todo.put(_STOP)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued write is done; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # ---- writing ---------------------------------------------------------------------

    def put(self, enc: files.Encoded) -> bool:
        """Queue `enc` for writing. False (and nothing queued) when it alone exceeds the
        tier, or the queue already holds `max_pending` bytes (the disk is behind)."""
        size = enc.nbytes
        with self._lock:
            if size > self.max_bytes or self._pending + size > self.max_pending:
                self.skipped += 1
                return False
            self._pending += size
        self._todo.put(enc)
        return True

    def _writer(self) -> None:
        while (enc := self._todo.get()) is not _STOP:
            path = self.dir / _file_name(enc.name)
            t0 = time.perf_counter()
            try:
                nbytes = files.write(enc, path, self.identity)
            except OSError as e:
                log.warning("could not write a KV snapshot (%s); it stays in memory only", e)
                nbytes = 0
            seconds = time.perf_counter() - t0
            with self._lock:
                self._pending -= enc.nbytes
                if nbytes:
                    old = self._index.pop(enc.name, None)
                    self.nbytes += nbytes - (old.nbytes if old else 0)
                    self._index[enc.name] = OnDisk(path, nbytes, len(enc.tokens), self._clock())
                    self.write_bytes += nbytes
                    self.write_seconds += seconds
                    self._evict(keep=enc.name)
                self._idle.notify_all()
            del enc  # its views: the MLX arrays they keep alive can go

    def _evict(self, keep: Optional[str] = None) -> None:
        """Drop least recently used files until the tier fits (lock held)."""
        while self.nbytes > self.max_bytes and self._index:
            name = next(iter(self._index))
            if name == keep:
                if len(self._index) == 1:
                    break
                self._index.move_to_end(name)
                continue
            self._forget(name)
            self.evictions += 1

    # ---- reading ---------------------------------------------------------------------

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._index

    def load(self, name: str) -> Optional[files.Snapshot]:
        """The snapshot `name`, read and verified; None if there is none or it was
        corrupt (then deleted and counted)."""
        with self._lock:
            entry = self._index.get(name)
        if entry is None:
            return None
        t0 = time.perf_counter()
        try:
            snap = files.read(entry.path)
            self._check(snap, entry.path, name)
        except FileNotFoundError:
            with self._lock:
                self._forget(name, unlink=False)
            return None
        except (OSError, files.CorruptFile) as e:
            with self._lock:
                self._forget(name, unlink=False)
            self._discard(entry.path, e)
            return None
        seconds = time.perf_counter() - t0
        now = self._clock()
        with self._lock:
            self.read_bytes += snap.nbytes
            self.read_seconds += seconds
            if name in self._index:
                self._index[name].used_at = now
                self._index.move_to_end(name)
        try:
            os.utime(entry.path, (now, now))  # the LRU order, for the next start
        except OSError:
            pass
        return snap

    # ---- admin -----------------------------------------------------------------------

    def drop(self, name: str, corrupt: bool = False) -> bool:
        """Delete `name`'s file (`corrupt`: counted as a corrupt file)."""
        with self._lock:
            if name not in self._index:
                return False
            self._forget(name)
            self.corrupt += corrupt
            return True

    def clear(self) -> int:
        with self._lock:
            names = list(self._index)
            for name in names:
                self._forget(name)
            return len(names)

    def entries(self) -> dict[str, OnDisk]:
        with self._lock:
            return dict(self._index)

    def stats(self) -> dict:
        with self._lock:
            return {"disk_bytes": self.nbytes, "disk_entries": len(self._index),
                    "disk_evictions": self.evictions, "disk_corrupt": self.corrupt,
                    "disk_read_bytes": self.read_bytes,
                    "disk_read_seconds": round(self.read_seconds, 6),
                    "disk_write_bytes": self.write_bytes,
                    "disk_write_seconds": round(self.write_seconds, 6)}

    # ---- internals -------------------------------------------------------------------

    def _forget(self, name: str, unlink: bool = True) -> None:
        """Remove `name` from the index (lock held), and its file."""
        entry = self._index.pop(name)
        self.nbytes -= entry.nbytes
        if unlink:
            entry.path.unlink(missing_ok=True)

    def _check(self, claims, path: Path, name: str) -> None:
        """Refuse a file (`claims`: what its header says) that is not the snapshot `name`
        of this model: named for another snapshot, or written by another model."""
        if path.name != _file_name(name) or claims.name != name:
            raise files.CorruptFile("holds another snapshot than it is named for")
        if claims.identity != self.identity:
            raise files.CorruptFile("written by another model")

    def _discard(self, path: Path, why: Exception) -> None:
        log.warning("deleted a corrupt KV snapshot file %s (%s)", path.name, why)
        with self._lock:
            self.corrupt += 1
        path.unlink(missing_ok=True)


def _file_name(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40] + _SUFFIX
