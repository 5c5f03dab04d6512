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
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from protocol.messages import INVALID_REQUEST, SamplingParams
from worker.prompt import RequestError

IMPOSSIBLE = -9999.0
_SEEDS = 2 ** 64  # mx.random.seed takes a uint64


def sampler_for(sp: SamplingParams, vocab_size: int):
    """mlx-lm's sampler for the request. top_k outside (0, vocab_size) keeps every token,
    which is what it means; mlx-lm would raise inside its compiled trace instead."""
    temp = 1.0 if sp.temperature is None else sp.temperature
    top_k = sp.top_k or 0
    if not 0 < top_k < vocab_size:
        top_k = 0
    return make_sampler(temp, top_p=sp.top_p or 0.0, min_p=sp.min_p or 0.0, top_k=top_k)


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


def reseed() -> None:
    """A fresh random key from the OS, replacing whatever a failed step left there."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little"))


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


def logprob_arrays(logprobs: mx.array, y: mx.array, k: int) -> tuple:
    """(sampled token's logprob, top-k ids, top-k logprobs), lazily, for one step."""
    chosen = mx.take_along_axis(logprobs, y[:, None], axis=-1)[0, 0]
    if k <= 0:
        return (chosen,)
    top = mx.argpartition(-logprobs[0], k - 1)[:k]
    return chosen, top, logprobs[0, top]


def read_logprobs(arrays: tuple) -> tuple[float, list[tuple[int, float]]]:
    """Evaluated logprob_arrays → (logprob, [(id, logprob)] best first)."""
    chosen = _finite(arrays[0].item())
    if len(arrays) == 1:
        return chosen, []
    pairs = sorted(zip(arrays[1].tolist(), map(_finite, arrays[2].tolist())),
                   key=lambda p: -p[1])
    return chosen, pairs


def _finite(x: float) -> float:
    return x if x > IMPOSSIBLE else IMPOSSIBLE
