"""A legacy completion's `echo`: the prompt sent back before the output, with each prompt
token's logprob under the model when the request asks for logprobs.

That is how evaluation harnesses score a text through a server: lm-evaluation-harness's
loglikelihood tasks send the context and continuation as one prompt with `echo`,
`logprobs: 1` and `max_tokens: 1`, and read the continuation's token logprobs (and
whether each was the model's best) from `logprobs`; perplexity over a document is the same.

mlx-lm's batch keeps only a prefill's last logits, so a scored prompt is run through the
model here (`score`, on the MLX thread, before the batch takes it), chunk by chunk into a
fresh KV cache, reading each position's logprobs as it goes; that cache, holding all but
the prompt's last token, is where the batch then starts the sequence, so the prompt is
prefilled once. The pass is whole: a long scored prompt holds the batch's other sequences
for its prefill, where an ordinary prompt takes one chunk per step. The distribution is
the model's own, before any sampler or logits processor (as vLLM's prompt logprobs are).
Nothing precedes the first prompt token: its logprob is NaN on the wire (null in the
response) and its alternatives are placeholders. Without logprobs only the text comes back,
and the prompt starts from the KV cache as any other. With `max_tokens: 0` (the spec's
"prompt only") the scheduler sends the prompt and ends the request: nothing joins the batch.

The prompt Delta carries no token ids: it adds nothing to the completion's token counts.
"""

from __future__ import annotations

import math

import mlx.core as mx

from protocol.messages import Delta, pack_floats, pack_ids
from worker.kvcache.manager import Start, Tier
from worker.text.sampling import read_logprob_rows

NO_CONTEXT = math.nan
# Where the prompt cannot be scored: a worker group's ranks run every model pass together,
# step by step (worker/group/), and the one-request-at-a-time vision worker has no batch.
REFUSED = ("echo with logprobs is not supported by this model's worker (a worker group, "
           "or a vision model served one request at a time); echo alone is")
# A pass's float32 logits at most (positions x vocabulary): 128 MiB, 680 positions of
# a 49K vocabulary, 220 of Qwen's 152K; never more than the prefill step.
LOGITS_BYTES = 128 << 20


def score(model, ids: list[int], cache: list, k: int, step: int, vocab: int) -> list:
    """`ids[:-1]` through `model` into `cache`; per prompt token, (its logprob, its best
    `k` alternatives as (id, logprob)): the first token's is (NaN, [])."""
    rows = [(NO_CONTEXT, [])]
    body = ids[:-1]
    chunk = max(1, min(step, LOGITS_BYTES // (4 * max(1, vocab))))
    for start in range(0, len(body), chunk):
        part = body[start:start + chunk]
        logits = model(mx.array([part]), cache=cache)[0]
        mx.eval([c.state for c in cache])
        rows += read_logprob_rows(logits, ids[start + 1:start + 1 + len(part)], k)
    return rows


def scored_start(engine, prep, cache: list) -> Start | None:
    """`prep`'s prompt scored into `cache` (its rows on `prep.echo`): where the batch
    starts the sequence (None: a one-token prompt, nothing run)."""
    prep.echo = score(engine.model, prep.ids, cache, prep.gen.output.top_logprobs,
                      engine.prefill_step, engine.vocab_size)
    return Start(cache, len(prep.ids) - 1, Tier.PREFIX) if len(prep.ids) > 1 else None


def delta(engine, prep, epoch: int, rid: str) -> Delta:
    """The prompt as it goes out first: its text (as sent, or its ids decoded), and with
    logprobs (`prep.echo`, from `score`) each token's row as a step's are packed."""
    gen = prep.gen
    text = gen.prompt if gen.prompt is not None else engine.tokenizer.decode(prep.ids)
    if prep.echo is None:
        return Delta(epoch=epoch, rid=rid, text=text)
    k = gen.output.top_logprobs
    logprobs, top_ids, top_logprobs, token_bytes = [], [], [], []
    for tok, (lp, top) in zip(prep.ids, prep.echo):
        top = top or [(0, NO_CONTEXT)] * k  # (the first token: placeholders)
        logprobs.append(lp)
        token_bytes.append(engine.token_bytes(tok))
        for t, v in top:
            top_ids.append(t)
            top_logprobs.append(v)
            token_bytes.append(engine.token_bytes(t) if not math.isnan(v) else b"")
    return Delta(epoch=epoch, rid=rid, text=text, logprobs=pack_floats(logprobs),
                 top_ids=pack_ids(top_ids), top_logprobs=pack_floats(top_logprobs),
                 token_bytes=token_bytes)
