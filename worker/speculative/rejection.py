"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for drafters
that have a distribution: the draft model and the MTP head, at temperature > 0.

verify.py's greedy-match keeps a drafted token only where the target, sampling on its
own, drew the same token: lossless, but it keeps a draft x of q with probability p(x),
where rejection sampling keeps it with min(1, p(x)/q(x)) and, on a rejection, draws from
norm(max(0, p - q)); after a whole draft kept, one bonus token from p. The text's
distribution is the target's either way; rejection sampling keeps more of the draft.
mlx-lm (`speculative_generate_step`) and mlx-vlm 0.7.10 (its MTP and Gemma 4 verifiers)
verify by greedy match only, so the rule is here.

What p and q are: p is the distribution the sequence's own sampler draws from, the
target's log-probabilities after its logits processors (penalties, logit_bias, at each
drafted position with the draft before it: verify.py) and then mlx-lm's sampling chain
(top_p, min_p, top_k in mlx-lm's order, then the temperature): `RowSampling.distribution`
takes the filters and temperature from the sampler mlxd builds for those parameters
(worker/text/sampling.py's `SeededSampler`), so p is exactly what the sampler samples. q
is the draft model's (or the MTP head's) distribution after the SAME chain, and the
draft is drawn from that very q and kept with it, which is all the rule needs to be
exact. The chain makes q close to p (a draft from a token top_k drops would be rejected
anyway). q does NOT get the sequence's penalties or logit_bias: they are functions of
each row's text that the draft's batch does not keep, and the rule is exact for any q
(a biased p only lowers acceptance where the bias matters).

No processor or transform mlxd offers makes the rule unsound: p is always the
distribution the sequence's own sampler would draw from at that position (both are built
by worker/text/sampling.py's `sampler_for` from the same parameters), and q is the one
the draft was drawn from. A sampler whose distribution cannot be written down (mlx-lm's
XTC, which flips a coin per call) would; mlxd does not offer one.

Where it does not apply, verify.py's greedy-match does (lossless too): temperature 0
(the text must be exactly the target's greedy one), drafters whose draft is one fixed
guess (prompt lookup, Predicted Outputs: greedy match IS rejection sampling for a point
mass), and `Speculation.rejection` off (bench/speculative.py's side-by-side). A sequence
with a grammar never drafts.

Seeds: a seeded sequence draws its drafts, its uniforms and its residual and bonus tokens
from its own random key (from its seed), split once per draft and once per verification, so
the same seed and settings give the same text; an unseeded one uses MLX's global key.
"""

from __future__ import annotations

import mlx.core as mx
from msgspec.structs import replace

from worker.text.sampling import sampler_for

# A seeded sequence's key here is its seed's plus this: not the key stream its sampler
# draws the tokens it samples itself from (the same bits drawn twice would correlate).
_SALT = 0x5EC7


class RowSampling:
    """One sequence's sampling chain as a distribution, and its random keys."""

    def __init__(self, sp, vocab_size: int):
        seeded = sp.seed is not None
        self.chain = sampler_for(replace(sp, seed=(sp.seed if seeded else 0) + _SALT),
                                 vocab_size)
        self.key = self.chain.key if seeded else None

    def keys(self, n: int) -> list:
        """`n` fresh keys (None each for an unseeded sequence: the global key)."""
        if self.key is None:
            return [None] * n
        self.key, sub = mx.random.split(self.key)
        return list(mx.random.split(sub, n)) if n > 1 else [sub]

    def distribution(self, logprobs: mx.array) -> mx.array:
        """Log-probabilities (..., vocab) of what the sampler draws from `logprobs`."""
        logits = self.chain.scaled(logprobs)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample(self, logq: mx.array, key) -> mx.array:
        return mx.random.categorical(logq, key=key)


def of(sp, vocab_size: int) -> RowSampling | None:
    """The sequence's RowSampling where it samples (temperature > 0); None: greedy."""
    if sp is None or sp.temperature == 0:
        return None
    return RowSampling(sp, vocab_size)


def draft_tokens(rows: list, logits: mx.array, keys: list) -> tuple[mx.array, list]:
    """One drafting pass over a batch's rows: (tokens (n,), each sampling row's q
    log-probabilities (vocab,), None for a greedy row). `rows[i]`: RowSampling or None;
    `keys[i]`: that row's key for this pass."""
    if not any(rows):
        return mx.argmax(logits, axis=-1), [None] * len(rows)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens, qs = [], []
    for i, rs in enumerate(rows):
        if rs is None:
            tokens.append(mx.argmax(logits[i], axis=-1))
            qs.append(None)
        else:
            q = rs.distribution(logprobs[i])
            tokens.append(rs.sample(q, keys[i]))
            qs.append(q)
    return mx.stack(tokens), qs


def accept(rs: RowSampling, logprobs: mx.array, draft: list, logq: mx.array):
    """The rule over one row's draft (unevaluated): (whether each drafted token is kept
    (k,), the token to take at each position (k + 1,): from the residual norm(max(0,
    p - q)) where the draft is rejected there, and from p after the whole draft).
    `logprobs`: the target's processed log-probabilities at the row's positions (>= k +
    1, vocab); `logq` (k, vocab'): the draft's q, fitted to the target's vocabulary (a
    draft model's embedding may be padded otherwise)."""
    k = len(draft)
    logp = rs.distribution(logprobs[:k + 1])
    vocab = logp.shape[-1]
    if logq.shape[-1] > vocab:
        logq = logq[:, :vocab]
    elif logq.shape[-1] < vocab:
        logq = mx.pad(logq, [(0, 0), (0, vocab - logq.shape[-1])], constant_values=-mx.inf)
    d = mx.array([min(t, vocab - 1) for t in draft])[:, None]
    inside = mx.array([t < vocab for t in draft])
    lp = mx.take_along_axis(logp[:k], d, axis=-1)[:, 0]
    lq = mx.take_along_axis(logq, d, axis=-1)[:, 0]
    uniform_key, token_key = rs.keys(2)
    u = mx.random.uniform(shape=(k,), key=uniform_key)
    kept = (mx.log(u) + lq < lp) & inside  # (u < p/q, in logs)
    residual = mx.maximum(mx.exp(logp[:k]) - mx.exp(logq), 0.0)
    # (A residual of zero mass only follows p == q, where nothing is rejected: p then.)
    some = residual.sum(axis=-1, keepdims=True) > 0
    logr = mx.where(some, mx.log(residual), logp[:k])
    tokens = rs.sample(mx.concatenate([logr, logp[k:k + 1]], axis=0), token_key)
    return kept, tokens
