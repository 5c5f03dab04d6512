"""A worker group: one logical worker made of several MLX processes (one per machine or
GPU), joined by MLX's own distributed layer, the model split by mlx-lm's own sharding.

Why lockstep, and how. Every forward pass of a sharded model is collective: each rank
must call the model with the same shapes at the same moment (tensor parallel sums each
layer's partial results across ranks; pipeline parallel passes activations from rank to
rank). So every rank holds the same batch (its own shard of every sequence's KV) and
runs the same step. Rank 0 (the leader) runs the ordinary scheduler and speaks the
protocol to the supervisor; the others (followers) only replay what the leader did to its
batch, in the same order: each step's composition (sequences added and removed since the
last step, the prefill chunk size the leader's timing chose) travels from the leader in
one message before the step, over the group's control channel (`control.py`: ZeroMQ,
CURVE-encrypted; it says why not MLX's collectives, which carry every tensor). Sampling
needs no broadcast: after the collective sums every rank holds the same
logits, and the random state was seeded alike at start (`setup.py`), so every rank
samples the same tokens; a checksum of each step's tokens rides with the next broadcast
and a follower that disagrees stops the group rather than serve from a diverged state.

- `broadcast.py`: bytes from rank 0 to every rank over `all_sum`, framed (at startup).
- `control.py`, `keys.py`: the control channel and its keys.
- `leader.py`: the batch the leader's scheduler drives, recording what followers replay.
- `follower.py`: the loop of ranks > 0.
- `setup.py`: joining the group, the per-host memory check, shard loading, the link probe.
- `launch.py`: `python -m worker.group.launch`: the process the supervisor spawns; it
  starts the ranks with `mlx.launch`, beats for the group until the leader's link does,
  and dies with the supervisor.

A rank that dies makes the others' next collective fail (and `mlx.launch` stops the
rest): the leader exits, and the supervisor respawns the whole group, nothing half-alive.
A rank that hangs stops beating on the control channel; the leader's heartbeats say how
long (`group_silence`), and the supervisor's liveness check kills the whole group.
"""
