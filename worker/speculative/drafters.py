"""Drafters: where a sequence's guessed tokens come from. Neither needs extra weights.

`PromptLookup` guesses that the text goes on as it did after the last place its latest
few tokens appeared before, in the prompt or in the output so far (prompt lookup
decoding): an agent returning a file with one change repeats long runs of its prompt.
`Prediction` guesses from the text the client says the answer will mostly be (OpenAI's
Predicted Outputs), walking along it as the output agrees with it and finding its place
again, by the latest tokens, after the output departs from it.

Both keep an index of n-grams updated as tokens arrive, so a proposal costs the same
however long the context (a scan of a 4,000-token prompt per step in Python would cost
more than the step it saves on a small model).
"""

from __future__ import annotations

from typing import Protocol, Sequence

# The n-gram lengths matched, longest first: a longer match is a better guess; a single
# token still finds its place in a file being rewritten after a changed word.
NGRAMS = (3, 2, 1)


class Drafter(Protocol):
    def extend(self, tokens: Sequence[int]) -> None:
        """The sequence grew by `tokens` (accepted, in order)."""

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow the sequence so far (may be none)."""

    def ready(self) -> bool:
        """Whether the drafter has a guess for the text so far (cheap: asked each step
        before the pending token is known, to keep steps without drafts pipelined)."""


class NoGuess:
    """A drafter that never guesses: a grammar's sequence drafts only what its grammar
    forces (worker/speculative/grammar.py)."""

    def extend(self, tokens: Sequence[int]) -> None:
        pass

    def ready(self) -> bool:
        return False

    def propose(self, k: int) -> list[int]:
        return []


class _Index:
    """Where each n-gram of a token list ended (its latest occurrence, or every one)."""

    def __init__(self, every: bool = False):
        self.tokens: list[int] = []
        self.every = every
        self.ends: dict[tuple, object] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            for n in NGRAMS:
                if end >= n:
                    key = tuple(self.tokens[end - n:end])
                    if self.every:
                        self.ends.setdefault(key, []).append(end)
                    else:
                        self.ends[key] = end


class PromptLookup:
    """Prompt lookup: the continuation after the latest earlier occurrence of the
    sequence's last n tokens (n = 3, 2, 1), in the prompt and the output so far."""

    def __init__(self, prompt: Sequence[int]):
        self._index = _Index()
        self._pending: list[int] = []
        self._index.extend(prompt[:-1])
        self._pending = list(prompt[-1:])  # indexed once a token follows it

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._index.extend(self._pending + list(tokens[:-1]))
            self._pending = [tokens[-1]]

    def ready(self) -> bool:
        # (Whether the text up to the last token known had a guess: the pending token,
        # still being computed, is then likely to have one too.)
        return bool(self.propose(1))

    def propose(self, k: int) -> list[int]:
        # The index holds every token but the last: an n-gram ending at the last token
        # is looked up among the earlier ones, and its continuation is there.
        toks = self._index.tokens
        for n in NGRAMS:
            if len(toks) + 1 < n:
                continue
            key = tuple(toks[len(toks) - n + 1:]) + tuple(self._pending)
            end = self._index.ends.get(key)
            if end is not None and end < len(toks):
                out = toks[end:end + k]
                if len(out) < k and end + len(out) == len(toks):
                    out.extend(self._pending[:k - len(out)])
                return out
        return []


class Prediction:
    """Predicted Outputs: the client's predicted text, followed from where the output
    last agreed with it; after a departure, found again by the output's last n tokens
    (their first occurrence at or after the place last agreed, else their first)."""

    def __init__(self, predicted: Sequence[int]):
        self.predicted = list(predicted)
        self._index = _Index(every=True)
        self._index.extend(self.predicted)
        self._recent: list[int] = []
        self.at = 0  # where the output goes on in the prediction, if it agrees
        self.synced = 0  # the output's last tokens that the prediction holds there

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self._recent = (self._recent + [tok])[-max(NGRAMS):]
            if self.at is not None and self.at < len(self.predicted) \
                    and self.predicted[self.at] == tok:
                self.at += 1
                self.synced += 1
            else:
                self.at, self.synced = self._find()

    def _find(self):
        last = self.at or 0
        for n in NGRAMS:
            if len(self._recent) < n:
                continue
            ends = self._index.ends.get(tuple(self._recent[-n:]))
            if ends:
                later = [e for e in ends if e >= last]
                return (later[0] if later else ends[0]), n
        return None, 0

    def ready(self) -> bool:
        return self.at is not None and self.at < len(self.predicted)

    def propose(self, k: int) -> list[int]:
        if self.at is None:
            return []
        return self.predicted[self.at:self.at + k]
