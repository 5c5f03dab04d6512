"""What drafting with a draft model can earn, priced at load (worker/loading/draft.py).

A draft model's pass costs a fraction of the target's step (measured at load:
draft_model.step_cost). Drafting k tokens costs k passes and a verify step, and brings on
average (1 - a^(k+1)) / (1 - a) tokens at acceptance a (each drafted token kept while the
ones before it were, the target's own token included). A draft that no length k can make
pay at a generous acceptance is left off: the 4-bit demo draft, whose pass cost 0.87 of a
step on a lent H200, got past the older rule (a pass under one step) and ran at
0.77-0.81 x there.
"""

from __future__ import annotations

# The acceptance a draft model is priced at when it loads: generous (a 4-bit copy of the
# demo model kept 78% of its drafts on an agent edit, 23-43% on prose).
ACCEPTANCE = 0.8


def best_draft(pass_cost: float, verify: float = 1.0, acceptance: float = ACCEPTANCE,
               longest: int = 8) -> tuple[int, float]:
    """(k, tokens per target step) of the draft length that pays best for a drafter whose
    pass costs `pass_cost` target steps, with a verify step of `verify` steps: drafting k
    tokens, each kept with probability `acceptance` while the ones before it were, yields
    (1 - a^(k+1)) / (1 - a) tokens (the target's own included) for k x pass_cost + verify
    steps; (0, 1.0) where no k from 1 to `longest` beats a plain step's one token."""
    best = (0, 1.0)
    for k in range(1, max(0, longest) + 1):
        tokens = sum(acceptance ** i for i in range(k + 1))
        rate = tokens / (k * pass_cost + verify)
        if rate > best[1]:
            best = (k, rate)
    return best
