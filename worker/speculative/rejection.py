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
anyway), and so does the sequence's logit_bias, which q gets too (it does not depend on
the text). q does NOT get the sequence's penalties: they are functions of each row's
text that the draft's batch does not keep, and the rule is exact for any q (penalties on
p only lower acceptance where they matter).

No processor or transform mlxd offers makes the rule unsound: p is always the
distribution the sequence's own sampler would draw from at that position (both are built
by worker/text/sampling.py's `sampler_for` from the same parameters), and q is the one
the draft was drawn from. A sampler whose distribution cannot be written down (mlx-lm's
XTC, which flips a coin per call) would; mlxd does not offer one.

Where it does not apply, verify.py's greedy-match does (lossless too): temperature 0
(the text must be exactly the target's greedy one), drafters whose draft is one fixed
guess (prompt lookup, Predicted Outputs: greedy match IS rejection sampling for a point
mass), and `Speculation.rejection` off (bench/speculative.py's side-by-side). A sequence
with a grammar has its drafts cut to what the grammar allows, and its forced tokens are
one fixed guess (grammar.py).

Seeds: a seeded sequence draws its drafts, its uniforms and its residual and bonus tokens
from its own random key (from its seed), split once per draft and once per verification, so
the same seed and settings give the same text, alone or in any batch; an unseeded one uses
MLX's global key.

Batched: on a GPU each small op launch and each read of a result costs tens of µs, so the
rule runs as array operations over all of a step's rejection rows at once (one p (r, k + 1,
vocab), one q (r, k, vocab), drafts right-padded and masked), drawing every row's uniforms
and tokens in one vmapped op from a (r, SLOTS, 2) array of per-row keys; the chain
(filters, temperature) is applied once per distinct settings; verify.py reads the outcome
back with the greedy-match rows' in one read a step.
"""

from __future__ import annotations

import mlx.core as mx
from msgspec.structs import replace

from worker.text.sampling import sampler_for

# A seeded sequence's key here is its seed's plus this: not the key stream its sampler
# draws the tokens it samples itself from (the same bits drawn twice would correlate).
_SALT = 0x5EC7
# Keys a row draws per pass (`keys`): a fixed count, so that what a row draws does not
# depend on how long its batch-mates' drafts are (MLX's draws of n values are not
# prefixes of each other's). A verification takes the first half for its uniforms and
# the second for its tokens: drafts up to SLOTS / 2 - 1 tokens (max_draft_tokens is 8).
SLOTS = 64

_categorical = mx.vmap(lambda logits, key: mx.random.categorical(logits, key=key))
_uniform = mx.vmap(lambda key: mx.random.uniform(key=key))
_split = mx.vmap(lambda key: mx.random.split(key, SLOTS + 1))


class RowSampling:
    """One sequence's sampling chain as a distribution, and its random key."""

    def __init__(self, sp, vocab_size: int):
        seeded = sp.seed is not None
        self.chain = sampler_for(replace(sp, seed=(sp.seed if seeded else 0) + _SALT),
                                 vocab_size)
        self.key = self.chain.key if seeded else None
        # (rows with equal settings share one application of the chain: `distribution`)
        self.settings = (sp.temperature, sp.top_p, sp.min_p, sp.top_k)
        self.logit_bias = dict(sp.logit_bias or ())
        self._bias = None  # (vocab,): the bias q gets too (`bias`)

    def bias(self, vocab: int) -> mx.array:
        """Its logit_bias as a (vocab,) row of additions (zeros without one)."""
        if self._bias is None or self._bias.shape[0] != vocab:
            row = [0.0] * vocab
            for tok, b in self.logit_bias.items():
                if tok < vocab:
                    row[tok] = b
            self._bias = mx.array(row)
        return self._bias


def of(sp, vocab_size: int) -> RowSampling | None:
    """The sequence's RowSampling where it samples (temperature > 0); None: greedy."""
    if sp is None or sp.temperature == 0:
        return None
    return RowSampling(sp, vocab_size)


def keys(rows: list, own: list | None = None) -> mx.array:
    """(rows, SLOTS, 2) fresh keys for each row, in a few ops for the batch: a seeded row's
    from its own key (split once a call, so the same seed draws the same keys alone or in
    any batch), an unseeded one's, or one whose `own[i]` is false (it draws for nothing,
    and its key must not move), from MLX's global key."""
    seeded = [i for i, r in enumerate(rows)
              if r.key is not None and (own is None or own[i])]
    if len(seeded) < len(rows):
        out = mx.random.randint(0, 2 ** 31 - 1, (len(rows), SLOTS, 2), dtype=mx.uint32)
    if seeded:
        split = _split(mx.stack([rows[i].key for i in seeded]))
        for j, i in enumerate(seeded):
            rows[i].key = split[j, 0]
        if len(seeded) == len(rows):
            return split[:, 1:]
        out[mx.array(seeded)] = split[:, 1:]
    return out


def distribution(rows: list, logprobs: mx.array) -> mx.array:
    """Log-probabilities (rows, ..., vocab) of what each row's sampler draws from its
    `logprobs` (rows, ..., vocab): the chain applied once per distinct settings."""
    shape = logprobs.shape
    groups: dict = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.settings, []).append(i)
    if len(groups) == 1:
        logits = rows[0].chain.scaled(logprobs.reshape(-1, shape[-1]))
    else:
        order = [i for members in groups.values() for i in members]
        parts = [rows[m[0]].chain.scaled(logprobs[mx.array(m)].reshape(-1, shape[-1]))
                 .reshape(len(m), -1) for m in groups.values()]
        inverse = mx.argsort(mx.array(order))
        logits = mx.concatenate(parts)[inverse]
    logits = logits.reshape(shape)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample(logq: mx.array, keys: mx.array) -> mx.array:
    """A token from each row of `logq` (..., vocab), each with its key in `keys` (..., 2)."""
    flat = _categorical(logq.reshape(-1, logq.shape[-1]), keys.reshape(-1, 2))
    return flat.reshape(logq.shape[:-1])


def draft_tokens(rows: list, logits: mx.array, keys: mx.array | None):
    """One drafting pass over a batch's rows: (tokens (n,), q log-probabilities (s, vocab)
    of its s sampling rows, in order; None where none samples). `rows[i]`: RowSampling
    or None (greedy); `keys` (s, 2): each sampling row's key for this pass."""
    tokens = mx.argmax(logits, axis=-1)
    sampling = [i for i, r in enumerate(rows) if r is not None]
    if not sampling:
        return tokens, None
    if len(sampling) < len(rows):
        logits = logits[mx.array(sampling)]
    if any(rows[i].logit_bias for i in sampling):  # (q as close to p as is cheap)
        vocab = logits.shape[-1]
        logits = logits + mx.stack([rows[i].bias(vocab) for i in sampling])
    q = distribution([rows[i] for i in sampling],
                     logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    drawn = sample(q, keys).astype(tokens.dtype)
    if len(sampling) == len(rows):
        return drawn, q
    tokens[mx.array(sampling)] = drawn
    return tokens, q


def fit(logq: mx.array, vocab: int) -> mx.array:
    """A draft's q (..., vocab') on the target's vocabulary (a draft model's embedding
    may be padded otherwise)."""
    if logq.shape[-1] > vocab:
        return logq[..., :vocab]
    if logq.shape[-1] < vocab:
        pad = [(0, 0)] * (logq.ndim - 1) + [(0, vocab - logq.shape[-1])]
        return mx.pad(logq, pad, constant_values=-mx.inf)
    return logq


def accept(rows: list, logprobs: mx.array, drafts: mx.array, lengths: list,
           logq: mx.array):
    """The rule over the drafts of several rows at once (unevaluated): (whether each
    drafted token is kept (r, k), the token to take at each position (r, k + 1): from the
    residual norm(max(0, p - q)) where the draft is rejected there, and from p after the
    whole draft). `logprobs` (r, >= k + 1, vocab): the target's processed
    log-probabilities at the rows' positions; `drafts` (r, k): the drafts right-padded to
    the longest, `lengths` theirs; `logq` (r, k, vocab'): their q, padded alike. A row's
    draws come from its own keys at fixed slots, so its outcome is the same in any batch."""
    k = drafts.shape[1]
    logp = distribution(rows, logprobs[:, :k + 1])
    vocab = logp.shape[-1]
    logq = fit(logq, vocab)
    d = mx.minimum(drafts, vocab - 1)[..., None]
    lp = mx.take_along_axis(logp[:, :k], d, axis=-1)[..., 0]
    lq = mx.take_along_axis(logq, d, axis=-1)[..., 0]
    drawn = keys(rows)
    u = _uniform(drawn[:, :k].reshape(-1, 2)).reshape(-1, k)
    within = mx.arange(k)[None] < mx.array(lengths)[:, None]
    kept = (mx.log(u) + lq < lp) & (drafts < vocab) & within  # (u < p/q, in logs)
    residual = mx.maximum(mx.exp(logp[:, :k]) - mx.exp(logq), 0.0)
    # (A residual of zero mass only follows p == q, where nothing is rejected: p then;
    # past a row's draft, p: its bonus token.)
    some = (residual.sum(axis=-1, keepdims=True) > 0) & within[..., None]
    logr = mx.where(some, mx.log(residual), logp[:, :k])
    half = SLOTS // 2
    tokens = sample(mx.concatenate([logr, logp[:, k:k + 1]], axis=1),
                    drawn[:, half:half + k + 1])
    return kept, tokens
