"""`mlxctl cache` in the worker: the answer to a CacheCommand (list, save, drop or clear
the KV snapshots) from the batch's KV cache manager (manager.py). The scheduler hands each
command here between steps, on the MLX thread, which owns the caches."""

from __future__ import annotations

from protocol.messages import CacheCommand, CacheReply


def answer(kvcache, cmd: CacheCommand, epoch: int) -> CacheReply:
    """The reply to `cmd`; `kvcache`: the batch's KV cache manager, None when the worker
    keeps no prompt cache."""
    reply = {"epoch": epoch, "qid": cmd.qid}
    if kvcache is None:
        return CacheReply(**reply, ok=False, message="this worker keeps no KV snapshots "
                          "(its prompt cache is off: --prompt-cache-bytes 0)")
    if cmd.op == "ls":
        return CacheReply(**reply, entries=kvcache.entries())
    if cmd.op == "clear":
        return CacheReply(**reply, message=f"cleared {kvcache.clear()} snapshots and "
                          "the prompt cache")
    if not cmd.name:
        return CacheReply(**reply, ok=False, message=f"`{cmd.op}` needs a snapshot name")
    if cmd.op == "save":
        ok, message = kvcache.save(cmd.name)
        return CacheReply(**reply, ok=ok, message=message)
    if kvcache.drop(cmd.name):
        return CacheReply(**reply, message=f"dropped {cmd.name}")
    return CacheReply(**reply, ok=False, message=f"no snapshot named {cmd.name}")
