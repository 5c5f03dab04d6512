"""One batched step that verifies every speculating sequence's draft.

mlx-lm's GenerationBatch advances each sequence by one token a step, with the next step
launched before the current token is read (worker/loop/batch.py). A speculating step
cannot be pipelined that way: what is fed next depends on what was accepted. So when any
sequence of the batch has a draft (`Speculation.wants`), `next` runs `verify` instead:

- each row's input is its pending token (sampled at the previous step, not yet in the
  KV cache) followed by its draft, right-padded to the longest draft; a sequence without
  a draft (not speculating now) takes its one token in the same forward;
- a sequence's logits processors (penalties, logit_bias, a grammar's mask: functions of
  the tokens so far) process each of its positions with the tokens before it, the
  draft's included, as decoding the draft one token a step would (`_processed`); its
  token history keeps only the tokens kept, and its grammar gives back the rejected
  tokens it consumed (grammar.py: a grammar's drafts are cut to what it allows);
- every position is sampled with the sequence's own sampler, and a draft token is kept
  while it equals the token the target model sampled at its position. For a draft that is
  one fixed guess this IS rejection sampling (keep the guess d with probability p(d),
  else draw from p without d): at temperature 0 the text is the target's own, at any
  temperature its distribution; a seeded sampler draws the same keys for the same drafts,
  so a seed reproduces its output. A draft sampled from a distribution q (a draft model,
  the MTP head, at temperature > 0: `Speculation.sampled`) is verified by rejection
  sampling instead (rejection.py: kept with probability min(1, p/q), the next token
  from the residual or, after the whole draft, from p), which keeps more of it;
- the tokens reported are the pending one and the accepted drafts, each with the
  log-probability row it was sampled from, in order, through the batch's usual per-token
  path (stop tokens, the token budget here; stop strings, logprobs, tool and reasoning
  parsing in worker/text/decoding.py); a sequence that ends inside its accepted run
  reports up to its last token;
- the KV cache keeps exactly the reported tokens: the rows' rejected positions are
  trimmed (the fewest any row rejected, off every row: `trim`), and rows that rejected
  more are rolled right by the difference into their left padding (mlx-lm's own
  right-padding `finalize`), so no rejected token stays in a cache the prompt cache or a
  snapshot later takes.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import ArraysCache

from worker.speculative import recurrent, rejection


def install() -> None:
    """`GenerationBatch.next` verifies drafts when the batch has a Speculation attached
    (`attach`) that wants it; otherwise it is mlx-lm's, and the Speculation only sees the
    tokens reported."""
    original = GenerationBatch.next
    if getattr(original, "mlxd_speculative", False):
        return

    @functools.wraps(original)
    def next(self):
        spec = self.__dict__.get("mlxd_speculation")
        if spec is None or not self.uids:
            return original(self)
        if spec.wants(self.uids):
            try:
                responses = verify(self, spec)
            finally:
                recurrent.done()
            if responses is not None:
                return responses
            fed = True  # (no sequence drafted after all: mlx-lm's step)
        else:
            fed = False
        responses = original(self)
        spec.reported(responses, fed)
        return responses

    next.mlxd_speculative = True
    GenerationBatch.next = next


def attach(generator, speculation) -> None:
    """Speculate in this BatchGenerator's generation batch (one object for its life: new
    sequences are merged into it)."""
    generator._generation_batch.mlxd_speculation = speculation
    speculation.attached(generator)


def verify(gb, spec) -> list | None:
    """One verification step of the whole batch: mlx-lm's Responses, several per
    sequence (its reported tokens in order); None when no sequence drafted after all
    (its drafters have the pending tokens: mlx-lm's step reports them)."""
    n = len(gb.uids)
    current = gb._next_tokens
    mx.eval(current, gb._next_logprobs)
    pending = current.tolist()
    rooms = [max(0, gb.max_tokens[i] - gb._num_tokens[i] - 1)  # (the pending token
             for i in range(n)]                                # takes one)
    drafts = spec.propose_all(gb.uids, pending, rooms)
    width = 1 + max(len(d) for d in drafts)
    if width == 1 and not spec.always_verify:
        return None
    rows = [[p] + d + [0] * (width - 1 - len(d)) for p, d in zip(pending, drafts)]
    inputs = mx.array(rows, dtype=current.dtype)

    positions = getattr(gb.model, "mlxd_positions", None)
    if positions is not None:  # (a VLM's rows' rotary deltas: worker/vision/language.py)
        positions.rows(gb.uids)
    recurrent.start()
    try:
        logits = spec.forward(gb, inputs)  # (n, width, vocab)
    finally:
        if positions is not None:
            positions.done()
    history = None  # (a processed row's token history before this step)
    if any(gb.logits_processors):
        logits, history = _processed(gb, inputs, drafts, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [gb.fallback_sampler if s is None else s
                for s in (gb.samplers or [None] * n)]
    rejecting = {i: got for i, uid in enumerate(gb.uids)  # (rejection.py verifies them)
                 if (got := spec.sampled(uid, len(drafts[i]))) is not None}
    if len(rejecting) == n:  # (a sampler is never called for a rejection row, so a
        sampled = mx.zeros((n, width), mx.uint32)  # seeded one's key moves alike alone)
    elif all(s is samplers[0] for s in samplers):
        sampled = samplers[0](logprobs.reshape(n * width, -1)).reshape(n, width)
    else:
        # (each row's own positions only: a seeded sampler's draws depend on the shape it
        # is given, and a row's must not depend on how long its batch-mates' drafts are;
        # none for a row whose tokens rejection sampling draws)
        sampled = mx.stack([mx.zeros((width,), mx.uint32) if e in rejecting
                            else _padded(s(logprobs[e, :1 + len(d)]), width)
                            for e, (s, d) in enumerate(zip(samplers, drafts))])
    chosen, matched = _outcome(rejecting, drafts, inputs, logprobs, sampled)
    read = mx.concatenate([chosen.astype(mx.int32), matched.astype(mx.int32)], axis=1)
    read = read.tolist()  # (the step's one read: every row's tokens and kept drafts)
    sampled = [r[:width] for r in read]
    kept = [r[width:] for r in read]

    responses, keep, kept_positions = [], [], []
    earned = 0  # (drafted tokens kept, every row's: what the step bought the batch)
    next_tokens, next_logprobs = [], []
    for i, uid in enumerate(gb.uids):
        draft = drafts[i]
        accepted = 0
        while accepted < len(draft) and kept[i][accepted]:
            accepted += 1
        tokens = [pending[i]] + draft[:accepted]
        rows_lp = [gb._next_logprobs[i]] + [logprobs[i, j] for j in range(accepted)]
        finish = None
        for j, tok in enumerate(tokens):
            gb._num_tokens[i] += 1
            if gb._num_tokens[i] >= gb.max_tokens[i]:
                finish = "length"
            if gb._matchers[i].advance(tok):
                finish = "stop"
            if finish is not None:
                tokens, rows_lp = tokens[:j + 1], rows_lp[:j + 1]
                break
        kept_positions.append(len(tokens))
        if history is not None and history[i] is not None:  # (the tokens kept)
            gb._token_context[i]._size = history[i] + len(tokens)
        gb.tokens[i].extend(tokens)
        earned += len(tokens) - 1 if finish else accepted
        spec.verified(uid, draft, len(tokens) - 1 if finish else accepted, tokens[1:],
                      None if finish else sampled[i][accepted])
        last = len(tokens) - 1
        for j, tok in enumerate(tokens):
            responses.append((i, tok, rows_lp[j], finish if j == last else None))
        if finish is None:
            keep.append(i)
        next_tokens.append(sampled[i][accepted])
        next_logprobs.append(logprobs[i, accepted])

    _keep_only(gb.prompt_cache, [width - k for k in kept_positions])
    gb._current_tokens = current
    gb._current_logprobs = [r[2] for r in responses]
    gb._next_tokens = mx.array(next_tokens, dtype=current.dtype)
    gb._next_logprobs = next_logprobs
    mx.async_eval(gb._next_tokens, gb._next_logprobs)
    spec.batch_verified(gb.uids, drafts, earned)
    spec.stepped()

    out = []
    for i, tok, lp, finish in responses:
        ended = finish is not None
        out.append(GenerationBatch.Response(
            uid=gb.uids[i], token=tok, logprobs=lp, finish_reason=finish,
            prompt_cache=gb.extract_cache(i) if ended else None,
            all_tokens=gb.tokens[i] if ended else None))
    if len(keep) < n:
        gb.filter(keep)
    return out


def _padded(tokens: mx.array, width: int) -> mx.array:
    return tokens if tokens.shape[0] == width else mx.pad(tokens, [(0, width - tokens.shape[0])])


def _outcome(rejecting: dict, drafts, inputs, logprobs, sampled):
    """(the token to take at each position (n, width), whether each drafted token is
    kept (n, width - 1)), unevaluated: a greedy-match row keeps a draft token where the
    target's own sample equals it; the rows whose drafts were sampled from a q
    (`rejecting`: row -> its RowSampling and q) are verified together by rejection
    sampling (rejection.py)."""
    draft = inputs[:, 1:]
    matched = sampled[:, :-1] == draft
    k = draft.shape[1]
    which = list(rejecting)
    rows = [rejecting[i][0] for i in which]
    qs = [q if q.shape[0] == k else mx.pad(q, [(0, k - q.shape[0]), (0, 0)])
          for q in (rejecting[i][1] for i in which)]
    if not rows:
        return sampled, matched
    at = mx.array(which)
    kept, tokens = rejection.accept(rows, logprobs[at], draft[at],
                                    [len(drafts[i]) for i in which], mx.stack(qs))
    if len(rows) == len(drafts):
        return tokens.astype(sampled.dtype), kept
    sampled[at] = tokens.astype(sampled.dtype)
    matched[at] = kept
    return sampled, matched


def _processed(gb, inputs, drafts, logits):
    """(`logits` with each row's processors applied at each of its positions, given the
    tokens before it; each processed row's history length before this step, else None).
    mlx-lm's TokenBuffer has no trim: `verify` sets its `_size` back to what was kept."""
    rows, history = [], []
    for e, draft in enumerate(drafts):
        processors = gb.logits_processors[e] or ()
        if not processors:
            rows.append(logits[e])
            history.append(None)
            continue
        buffer = gb._token_context[e]
        before = buffer._size
        context = buffer.update_and_fetch(inputs[e, :1 + len(draft)])
        out = []
        for j in range(logits.shape[1]):
            row = logits[e:e + 1, j]
            if j <= len(draft):
                for processor in processors:
                    row = processor(context[:before + j + 1], row)
            out.append(row)
        rows.append(mx.concatenate(out, axis=0))
        history.append(before)
    return mx.stack(rows), history


def _keep_only(caches, rejected: list[int]) -> None:
    """Drop each row's last `rejected[i]` positions from the batch's KV caches (a
    recurrent layer's: its state at the row's last kept position, worker/speculative/
    recurrent.py)."""
    for c in caches:
        if recurrent.recorded(c):
            recurrent.keep(c, rejected)
    caches = [c for c in caches if not isinstance(c, ArraysCache)]
    least = min(rejected)
    if least:
        for c in caches:
            c.trim(least)
    extra = [r - least for r in rejected]
    if any(extra):  # (a batch of several rows: BatchKVCaches)
        for c in caches:
            c.prepare(right_padding=extra)
            c.finalize()
