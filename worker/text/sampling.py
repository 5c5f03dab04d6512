"""Samplers, logits processors and logprob extraction for one request (mlx-lm's own).

Logprobs reported to clients are the log-softmax of the logits after the processors that
reshape the distribution — repetition/presence/frequency penalties, logit_bias, the
grammar mask, a banned tool-call marker — and before temperature, top_p, top_k and
min_p (which only pick among them). So at temperature 0 the sampled token is the top
entry; a token the grammar forbids has logprob -inf, reported as -9999.0 (what OpenAI
reports for impossible tokens; JSON has no -inf).

mlx-lm's samplers are `mx.compile`d with `mx.random.state` as input AND output. If one
raises while it is being traced, the global random key is left holding the tracer: an
array without a primitive, and every later sample fails with "Attempting to eval an array
without a primitive". So values mlx-lm would refuse inside the trace are mapped here
first (top_k at or above the vocabulary means no filtering; any int64 seed maps onto
`mx.random.seed`'s uint64; a min_p outside [0, 1] is refused), and `reseed()` is the
cure for what still gets through.

In a batch (worker/loop/batch.py) every sequence has its own sampler, and mlx-lm's batch
makes ONE sampling call for the whole batch when all sequences share the same sampler
object. So samplers are shared: greedy is mlx-lm's one `greedy_sampler`, and unseeded
samplers are cached by their parameters. A seeded request cannot share the global random
key (`mx.random.seed` would reseed everyone's): it gets its own key, split once per step,
and the same filters as mlx-lm's chain (top_p, min_p, top_k, in mlx-lm's order), so a
seed reproduces its output alone or in any batch.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, make_logits_processors,
                                 make_sampler)

from protocol.messages import INVALID_REQUEST, SamplingParams
from worker.errors import RequestError

IMPOSSIBLE = -9999.0
_SEEDS = 2 ** 64  # mx.random.seed takes a uint64


def sampler_for(sp: SamplingParams, vocab_size: int):
    """The sampler for the request: shared by every request with the same parameters,
    its own for a seeded one. top_k outside (0, vocab_size) keeps every token, which is
    what it means; mlx-lm would raise inside its compiled trace instead."""
    temp = 1.0 if sp.temperature is None else sp.temperature
    top_k = sp.top_k or 0
    if not 0 < top_k < vocab_size:
        top_k = 0
    params = (float(temp), float(sp.top_p or 0.0), float(sp.min_p or 0.0), top_k)
    if sp.seed is not None and temp != 0:
        return SeededSampler(*params, seed=seed_value(sp.seed))
    return _shared_sampler(*params)


@lru_cache(maxsize=64)
def _shared_sampler(temp: float, top_p: float, min_p: float, top_k: int):
    return make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)


class SeededSampler:
    """mlx-lm's sampling chain with a random key of its own (see the module docstring)."""

    def __init__(self, temp: float, top_p: float, min_p: float, top_k: int, *, seed: int):
        self.temp = temp
        self.filters = []
        if 0 < top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, min_p))
        if top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, top_k))
        self.key = mx.random.key(seed)

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The logits it draws from: the filters, then the temperature (unnormalized;
        speculative rejection sampling normalizes them into p and q)."""
        for f in self.filters:
            logprobs = f(logprobs)
        return logprobs * (1.0 / self.temp)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(self.scaled(logprobs), key=sub)


def check_sampler_values(sp: SamplingParams) -> None:
    """Refuse what mlx-lm's compiled samplers would refuse inside their trace (the API
    validates these already; this keeps a value that slips through from the trace)."""
    if sp.min_p is not None and not 0.0 <= sp.min_p <= 1.0:
        raise RequestError(INVALID_REQUEST, f"min_p must be between 0 and 1, got {sp.min_p}",
                           "min_p")


def seed_value(seed: int) -> int:
    """The API's seed (any int64, negatives included) as `mx.random.seed` takes it:
    modulo 2**64, so every seed is accepted and the same seed gives the same output."""
    return seed % _SEEDS


def _os_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


_seed_source = _os_seed


def use_seed_source(source) -> None:
    """Where `reseed` takes its seeds: the OS by default; a worker group's ranks share a
    seeded generator, so that every rank reseeds alike and keeps sampling the same tokens
    (worker/group/setup.py)."""
    global _seed_source
    _seed_source = source


def reseed() -> None:
    """A fresh random key, replacing whatever a failed step left there."""
    mx.random.seed(_seed_source() % _SEEDS)


def check_logit_bias(sp: SamplingParams, vocab_size: int) -> None:
    """The pairs' shape is the protocol's ((int, float) pairs, checked when the frame was
    decoded); their ids must be in this model's vocabulary."""
    for tok, _ in sp.logit_bias:
        if not 0 <= tok < vocab_size:
            raise RequestError(INVALID_REQUEST, f"logit_bias: token id {tok} is out of range: "
                               f"the vocabulary has {vocab_size} tokens", "logit_bias")


def processors_for(sp: SamplingParams, banned: tuple = ()) -> list:
    """mlx-lm logits processors for the request's penalties and bias. `banned` token
    ids get -inf (tool_choice "none": the call marker)."""
    bias = dict(sp.logit_bias)
    rp = sp.repetition_penalty
    processors = make_logits_processors(
        logit_bias=bias or None,
        repetition_penalty=rp if rp not in (None, 1.0) else None,
        presence_penalty=sp.presence_penalty or None,
        frequency_penalty=sp.frequency_penalty or None,
    )
    if banned:
        ids = mx.array(list(banned))

        def ban(_, logits):
            return logits.at[:, ids].add(-mx.inf)

        processors.append(ban)
    return processors


def read_logprobs(row: mx.array, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """One step's (logprob of `token`, [(id, logprob)] of the best `k`, best first), from
    the evaluated log-probability row the batch sampled from."""
    values = np.asarray(row, dtype=np.float32).reshape(-1)
    chosen = _finite(float(values[token]))
    if k <= 0:
        return chosen, []
    k = min(k, values.size)
    top = np.argpartition(-values, k - 1)[:k]
    pairs = sorted(((int(t), _finite(float(values[t]))) for t in top), key=lambda p: -p[1])
    return chosen, pairs


def read_logprob_rows(logits: mx.array, targets: list[int], k: int) -> list:
    """`read_logprobs` for every position of `logits` (L x vocab, a prompt chunk's) at once,
    on the device: per position, (the logprob of `targets[i]`, the best `k`). Only the
    chosen and the best k of each row come to the host."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)[:, 0]
    k = min(k, lp.shape[-1])
    if k <= 0:
        return [(_finite(x), []) for x in chosen.tolist()]
    # (k == 1, what evaluation harnesses ask: a max, not a partition of every row)
    top = mx.argmax(lp, axis=-1, keepdims=True) if k == 1 else \
        mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    return [(_finite(x), sorted(((t, _finite(v)) for t, v in zip(ids, values)),
                                key=lambda p: -p[1]))
            for x, ids, values in zip(chosen.tolist(), top.tolist(), top_lp.tolist())]


def _finite(x: float) -> float:
    return x if x > IMPOSSIBLE else IMPOSSIBLE
