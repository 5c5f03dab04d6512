"""What drafting can earn, priced at load: a draft model (worker/loading/draft.py), and the
verify step every drafter pays for (`verify_price`, worker/loading/startup.py).

A draft model's pass costs a fraction of the target's step (measured at load:
draft_model.step_cost). Drafting k tokens costs k passes and a verify step, and brings on
average (1 - a^(k+1)) / (1 - a) tokens at acceptance a (each drafted token kept while the
ones before it were, the target's own token included). A draft that no length k can make
pay at a generous acceptance is left off: the 4-bit demo draft, whose pass cost 0.87 of a
step on a lent H200, got past the older rule (a pass under one step) and ran at
0.77-0.81 x there.
"""

from __future__ import annotations

import time

# The acceptance a draft model is priced at when it loads: generous (a 4-bit copy of the
# demo model kept 78% of its drafts on an agent edit, 23-43% on prose).
ACCEPTANCE = 0.8


def best_draft(pass_cost: float, verify=1.0, acceptance: float = ACCEPTANCE,
               longest: int = 8) -> tuple[int, float]:
    """(k, tokens per target step) of the draft length that pays best for a drafter whose
    pass costs `pass_cost` target steps, with a verify step of `verify` steps (or
    `verify(k)` for a draft of k: worker/loading/startup.py gives what the device
    measured): drafting k tokens, each kept with probability `acceptance` while the ones
    before it were, yields (1 - a^(k+1)) / (1 - a) tokens (the target's own included) for
    k x pass_cost + verify steps; (0, 1.0) where no k from 1 to `longest` beats a plain
    step's one token."""
    best = (0, 1.0)
    for k in range(1, max(0, longest) + 1):
        tokens = sum(acceptance ** i for i in range(k + 1))
        rate = tokens / (k * pass_cost + (verify(k) if callable(verify) else verify))
        if rate > best[1]:
            best = (k, rate)
    return best


def verify_costs(model, drafts, context: int = 64, reps: int = 3,
                 steps: int = 4) -> dict[int, float] | None:
    """{d: a step that verifies a draft of d tokens, in plain decode steps} for each d of
    `drafts` (the best of `reps` of each, interleaved with the plain runs they are
    measured against: the machine drifts); None where the model's cache cannot give
    positions back (recurrent layers: nothing to time it on without copying state).

    Timed in place, as the batch meets it: `steps` plain steps pipelined as mlx-lm
    decodes (the next step's graph built and launched before the current token is read),
    the verify step as verify.py runs it (the pending token read, 1 + d positions in one
    forward, read back before anything else is launched), `steps` more plain ones; less
    the same run without the verify. So its price holds what the verify breaks as well
    as its own forward: the plain step before it cannot overlap it, the one after starts
    with the device idle. What it costs over one plain step is what a draft must earn in
    accepted tokens (adaptive.py `Pace.verify`). It differs by device: on the demo model
    with OpenBLAS on this project's CPU the forward alone cost 0.99-1.36 plain steps, in
    place 1.13-1.27 (d=1) and 1.56-1.78 (d=8); on a lent H200, where a small model's step is
    its kernel launches, the forward alone 1.79-1.86 and in place 1.83 and 2.42 (two
    leases), and prose drafted by prompt lookup (0.87 tokens accepted a verification) ran
    at 0.80 x there while the fixed price (`MIN_GAIN`, 0.4) kept it drafting."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if not all(hasattr(c, "trim") and c.is_trimmable() for c in cache):
        return None
    mx.eval(model(mx.array([list(range(1, context + 1))]), cache=cache))

    def launch(tokens):
        y = mx.argmax(model(tokens, cache=cache)[:, -1], axis=-1)
        mx.async_eval(y)
        return y

    def plain(y, n: int):
        for _ in range(n):
            following = launch(y[:, None])
            y.item()
            y = following
        return y

    def run(draft: int | None) -> float:
        """`steps` plain steps, a verify of `draft` (None: none), `steps` plain ones."""
        t = time.perf_counter()
        y = plain(launch(mx.array([[7]])), steps - 1)
        positions = 2 * steps
        if draft is not None:
            pending = y.item()
            row = mx.argmax(model(mx.array([[pending] + [7] * draft]), cache=cache),
                            axis=-1).tolist()[0]
            y = mx.array([row[-1]])
            mx.async_eval(y)
            positions += 1 + draft
        plain(y, steps).item()
        dt = time.perf_counter() - t
        for c in cache:
            c.trim(positions)
        return dt

    sides = [None, *drafts]
    for d in sides:  # (each shape's first run compiles)
        run(d)
    times = {d: [] for d in sides}
    for _ in range(reps):
        for d in sides:
            times[d].append(run(d))
    base = min(times[None])
    step = max(1e-9, base / (2 * steps))
    return {d: max(0.0, min(times[d]) - base) / step for d in drafts}


# What a verify step costs beyond what `verify_costs` times, in plain steps: the
# drafter's own work and verify.py's bookkeeping of the kept tokens (a few hundred µs
# of Python against a small model's 4-6 ms step on a GPU host). Without it prose sat at
# the measured price on a lent H200 (0.82 tokens kept a verification against a price of
# 0.83-0.88) and kept drafting for nothing (0.75-0.96 x over four paired rounds).
UNMEASURED = 0.15


def verify_price(model, longest: int) -> tuple[float, float] | None:
    """(tokens a verification of one drafted token must earn, of `longest`): what each
    costs over a plain step (`verify_costs`) and UNMEASURED, never under `MIN_GAIN` (the
    measurement is a best case: a short context, no logits processors, no drafter's own
    work); None where it cannot be measured (adaptive.py then prices every verification
    at MIN_GAIN)."""
    from worker.speculative.adaptive import MIN_GAIN

    if longest < 1:
        return None
    costs = verify_costs(model, sorted({1, longest}))
    if costs is None:
        return None
    return tuple(max(MIN_GAIN, costs[d] - 1 + UNMEASURED) for d in (1, longest))
