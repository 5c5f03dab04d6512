"""Pipeline sharding's point-to-point transfers carried by all-reduces, for backends that
have no send/recv: MLX's CUDA backend (NCCL) in MLX 0.32 ("Recv has no CUDA
implementation"), so without this a pipeline-sharded group could not run on GPUs.

mlx-lm's pipeline (mlx_lm/models/pipeline.py and each model's `__call__`) passes the
activations down the ranks with `mx.distributed.recv_like` and `mx.distributed.send`:
rank N-1 runs the first layers and sends to rank N-2, ..., rank 1 sends to rank 0, and an
all_gather then gives every rank rank 0's output. Here transfer k (rank k to rank k-1)
is an all_sum that every rank joins, the sender with its activations and every other rank
with zeros, so the sum is the sender's array exactly (x + 0 is x in every float format).
Every rank joins the N-1 transfers in one order (N-1 first), each chained after the one
before it (`mx.depends`), so the collectives pair up across ranks: a rank joins the
transfers before the one it receives, receives, runs its layers, sends, and joins the
rest. For 2 ranks that is one all-reduce a step, as many collectives as send/recv; an
all-reduce moves about twice a send's bytes, and with more ranks every transfer waits for
every rank (a pipeline's ranks wait for each other anyway).

`install` replaces the two functions in `mx.distributed` for the whole process: a group
rank loads one model, and only a pipeline's layers call them.
"""

from __future__ import annotations

import mlx.core as mx

def _world(group):
    return group if group is not None else mx.distributed.init()


def _chain(x: mx.array, after: mx.array | None) -> mx.array:
    """Zeros like `x`, after `after` in the graph (so the collectives keep their order)."""
    zeros = mx.zeros_like(x)
    return zeros if after is None else mx.depends(zeros, after)


def _join(x: mx.array, transfers: range, group, stream, after=None) -> mx.array | None:
    """Join `transfers` that are not this rank's, with zeros, in order."""
    for _ in transfers:
        after = mx.distributed.all_sum(_chain(x, after), group=group, stream=stream)
    return after


def recv_like(x: mx.array, src: int, *, group=None, stream=None) -> mx.array:
    g = _world(group)
    rank, size = g.rank(), g.size()
    if src != rank + 1:
        raise NotImplementedError(f"rank {rank} receives only from rank {rank + 1} over "
                                  f"collectives (a pipeline's order), not from {src}")
    before = _join(x, range(size - 1, src, -1), g, stream)
    return mx.distributed.all_sum(_chain(x, before), group=g, stream=stream)


def send(x: mx.array, dst: int, *, group=None, stream=None) -> mx.array:
    g = _world(group)
    rank = g.rank()
    if dst != rank - 1:
        raise NotImplementedError(f"rank {rank} sends only to rank {rank - 1} over "
                                  f"collectives (a pipeline's order), not to {dst}")
    sent = mx.distributed.all_sum(x, group=g, stream=stream)
    rest = _join(x, range(rank - 1, 0, -1), g, stream, after=sent)
    return sent if rest is sent else mx.depends(sent, rest)


def install() -> None:
    mx.distributed.send = send
    mx.distributed.recv_like = recv_like
