"""What a worker counts and reports beside the messages themselves: its worker group's
ranks (Ready.group), its named KV snapshots (CacheReply), and the counters its Heartbeat
and Status carry (the prefix cache, the KV memory, speculation). Structs, not messages:
fields of the messages in protocol/messages.py, which re-exports them.
"""

from __future__ import annotations

from typing import Optional

import msgspec


class GroupRank(msgspec.Struct, frozen=True, kw_only=True):
    """One process of a worker group (worker/group/), as it was when the group was ready."""
    rank: int
    host: str
    pid: int
    free_bytes: int = 0      # memory its host had available before the shard loaded
    active_bytes: int = 0    # MLX memory it holds after loading
    peak_bytes: int = 0


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A worker group: several MLX processes serving one model (Ready.group)."""
    size: int
    backend: str             # ring | jaccl | mpi | nccl
    sharding: str            # tensor | pipeline
    ranks: list[GroupRank] = []
    latency_s: float = 0.0           # one tiny all-reduce, measured at start
    bandwidth_bytes_s: float = 0.0   # a 4 MiB all-reduce, measured at start


class SnapshotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One named KV snapshot (CacheReply)."""
    name: str
    tokens: int
    ram_bytes: int = 0          # 0: not in memory
    disk_bytes: int = 0         # 0: not on disk
    used_at: float = 0.0        # unix time of its last use (stored or resumed from)


class SnapshotStats(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's named KV snapshots (worker/kvcache/), counted since it started."""
    hits_ram: int = 0        # resumed from a state in memory
    hits_disk: int = 0       # resumed from a file of the disk tier
    misses: int = 0          # `resume_from` named no state in any tier
    fallbacks: int = 0       # the state's tokens did not begin the prompt: prefix matching
    named: int = 0           # names held in memory now
    disk_bytes: int = 0
    disk_entries: int = 0
    disk_evictions: int = 0  # files dropped for room (--kv-disk-bytes)
    disk_corrupt: int = 0    # files that failed their checksum or could not be read: deleted
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_write_bytes: int = 0
    disk_write_seconds: float = 0.0


class CacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's prompt-prefix cache (worker/kvcache/prefix.py), counted since it started
    (not a message: a field of Heartbeat and Status)."""
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0   # prompt tokens not prefilled thanks to it
    bytes: int = 0           # KV memory it holds now
    entries: int = 0
    evictions: int = 0       # dropped for room
    expirations: int = 0     # dropped for age (--prompt-cache-ttl)
    snapshots: Optional[SnapshotStats] = None  # None: no snapshots (no prompt cache)
    pinned_tokens: int = 0   # the --warm-prompt prefix held for the worker's life


class KVStats(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's KV memory (not a message: a field of Heartbeat): its format (`bits`
    0: full precision; worker/kvcache/quantized.py), what one token of context takes, and
    what the batch and the prompt cache hold now, in bytes and in tokens of context."""
    bits: int = 0
    bytes_per_token: float = 0.0
    bytes: int = 0
    tokens: int = 0


class SpeculationStats(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's speculative decoding (worker/speculative/), counted since it started
    (a field of Heartbeat): sequence-steps that verified a draft, tokens drafted, and
    those the model accepted. Acceptance is accepted / drafted; a verification yields
    (verifications + accepted) / verifications tokens."""
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
