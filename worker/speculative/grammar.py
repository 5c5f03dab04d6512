"""A grammar's part in a sequence's drafts: what it forces, what it forbids, and what a
verification leaves it holding.

A sequence with a grammar (response_format, a forced tool call: worker/text/
constraints.py) drafts like any other. Its `GrammarMask` (worker/text/decoding.py) is a
logits processor, and verify.py's `_processed` calls it at each position of the step with
the tokens before it: it consumes the pending token and the draft one by one and masks
every position as decoding them one a step would, so the target's sample at each
position is the one decoding would take there (at temperature 0 the text is decoding's
own). Three things keep that true:

- a draft is cut (`_fit`) at the first token the grammar would not take after the ones
  before it (a refused token puts llguidance's matcher in error, which is the request's
  failure), before an end-of-sequence token (the mask does not consume one), and before
  the token that would complete the grammar: `Decoding.feed` ends the sequence on the
  token after which the grammar is done, and it asks after the step, when the grammar
  holds every kept token, so no kept token may complete it but the last one of a step,
  the pending one (its next token is sampled at the next step, as without drafts);
- after the step the grammar gives back the rejected drafts (`rollback`), so it holds the
  pending token and the accepted drafts, as the KV cache does (verify.py `_keep_only`);
- where the grammar allows only one way on (a JSON schema's keys and punctuation, a tool
  call's name), llguidance's fast-forward tokens are the draft, whatever the drafter says
  (`forced`: jump-forward decoding). They are kept unless the model takes another
  tokenization of the same bytes, so a schema's fixed text costs a step per run of it,
  not a step per token.

Whether a step verifies is asked before the pending token is known (`Speculation.wants`):
`ahead` says the grammar forces the pending token and at least one after it (its
fast-forward tokens from the state before the pending one). A forced run that starts
right after a free token (a string's closing quote forces the next key) is found a step
later. Asking at every step while the grammar is open finds those too (the demo model's
JSON record, bench/speculative.py `json`: 58 steps for 91 tokens against 63, 93 without
drafts), but costs every free step of a grammar's batch its overlap: mlx-lm's step
builds the model's graph for the next token before the grammar's mask waits for the
pending one, a verify step only after it has read it, and on a GPU that graph's Python
is milliseconds of a small model's step.

A cut draft costs a drafter with a cache nothing more than a rejected one: a draft
model's row and the MTP head drop what the text did not keep before they next read
(draft_model.py, mtp.py). A draft sampled from a drafter's q (rejection sampling) is cut
as any other (the position after the cut is then drawn from the target's p, as after a
whole draft); forced tokens were not drawn from q, so they are verified as one fixed
guess (`Speculation.sampled`).
"""

from __future__ import annotations


class GrammarDraft:
    """One sequence's grammar, as its drafts see it (MLX thread only, as the mask)."""
    __slots__ = ("mask",)

    def __init__(self, mask):
        self.mask = mask  # the sequence's GrammarMask (worker/text/decoding.py)

    @property
    def _matcher(self):
        return self.mask.constraint.matcher

    def _usable(self) -> bool:
        m = self.mask
        return m.primed and m.failure is None and not m.constraint.done

    def ahead(self) -> bool:
        """Whether the grammar forces the pending token and another after it."""
        return self._usable() and len(self._matcher.compute_ff_tokens()) >= 2

    def forced(self, pending: int, k: int) -> list[int]:
        """Up to `k` tokens the grammar forces after `pending` (none: it leaves a choice)."""
        return self._after(pending, lambda: self._matcher.compute_ff_tokens()[:k])

    def valid(self, pending: int, draft: list[int]) -> list[int]:
        """The longest start of `draft` that may follow `pending` (see the docstring)."""
        return self._after(pending, lambda: draft) if draft else []

    def rollback(self, n: int) -> None:
        """The step kept all but the last `n` drafted tokens the mask consumed."""
        if n > 0 and self.mask.failure is None:
            self._matcher.rollback(n)

    def _after(self, pending: int, guess) -> list[int]:
        """`guess()`'s tokens, fitted, with the grammar past `pending` while it guesses;
        the grammar is where it was after."""
        if not self._usable() or pending in self.mask.eos:
            return []
        m = self._matcher
        if m.validate_tokens([pending]) != 1:
            return []
        m.consume_token(pending)
        try:
            return self._fit(guess())
        finally:
            m.rollback(1)

    def _fit(self, draft: list[int]) -> list[int]:
        m, eos = self._matcher, self.mask.eos
        draft = list(draft[:m.validate_tokens(draft)])
        for i, tok in enumerate(draft):
            if tok in eos:
                draft = draft[:i]
                break
        taken = 0
        try:
            for tok in draft:
                m.consume_token(tok)
                taken += 1
                if m.is_stopped():  # (it completes the grammar: not drafted)
                    return draft[:taken - 1]
            return draft
        finally:
            if taken:
                m.rollback(taken)
