"""A draft model (`--draft-model`): a second, smaller mlx-lm model in the same worker that
guesses each speculating sequence's next tokens by decoding them itself: greedily, or
for a sequence that samples by sampling them from its distribution q, which verify.py
then checks by rejection sampling (worker/speculative/rejection.py).

Why its own batch: drafting k tokens is k forward passes of the draft model, and a batch of
sequences drafting one pass at a time would cost k x the batch's size; so every sequence
drafting with it is a row of ONE batch KV cache (mlx-lm's BatchKVCache), and a draft is k
batched passes for all of them (`DraftModel.draft`, asked once per verification step by
worker/speculative/adaptive.py's `Speculation.propose_all`).

Its rows follow the target's sequences by their uid, not by position: a sequence that
joins the target's batch gets a row (`DraftRow`) whose prompt the draft model prefills
when it first drafts, and it is appended to the batch cache; one that leaves (finished,
cancelled, a failed step's reset) is filtered out. The draft model keeps its own prompt
cache (`prefix`, worker/kvcache/prefix.py: its states by their tokens, LRU within its
bytes): a row starts from the longest prefix of its prompt held there, and the state of
its prompt is kept there, so an agent's next turn, whose prompt is the last one and more,
prefills only what is new, in the draft model as in the target.
A row's text is what the target reported (the drafter protocol's `extend`, as for prompt
lookup); what the draft model has not read yet waits in the row's backlog and is read in
the next draft's first pass (rows right-padded to the longest backlog, as mlx-lm's
prefill pads). The draft model's cache holds its own guesses after a draft (it read d1 ..
dk-1 to guess d2 .. dk): before the next draft, each row keeps those the target accepted
and drops the rest (verify.py's `_keep_only`, per row), so no rejected token stays in it
when it next reads.

Lossless whatever the draft: at temperature 0 verify.py keeps a drafted token only where
the target itself chose it; at temperature > 0 each draft token is drawn from q (the
sequence's sampling chain applied to the draft model's distribution: its `sampling`) and
kept with probability min(1, p/q) (rejection.py), which keeps more of the draft than
matching the target's own sample would and gives the target's distribution all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.kvcache.prefix import PrefixCache
from worker.speculative import rejection
from worker.speculative.rows import Rows
from worker.speculative.verify import _keep_only

@dataclass
class DraftRow:
    """One sequence's drafter (worker/speculative/drafters.py's protocol), drafting with
    the worker's draft model."""
    group: "DraftModel"
    uid: int
    backlog: list = field(default_factory=list)  # its text the draft model has not read
    fed: list = field(default_factory=list)      # guesses the draft model read last draft
    since: list = field(default_factory=list)    # its text since that draft
    joined: bool = False                         # a row of the group's batch cache
    sampling: object = None  # rejection.RowSampling: it samples its draft (None: greedy)
    q: object = None         # the last draft's q log-probabilities (k, vocab), if sampled

    def extend(self, tokens: Sequence[int]) -> None:
        (self.since if self.fed else self.backlog).extend(tokens)

    def ready(self) -> bool:
        return True  # (a model always has a guess)

    @property
    def cost(self) -> float:
        return self.group.cost

    def propose(self, k: int) -> list[int]:
        """Alone (a batched step asks `DraftModel.draft`)."""
        return self.group.draft({self.uid: k}).get(self.uid, [])

    def close(self) -> None:
        self.group.leave(self.uid)

    def settle(self) -> int:
        """The text since the last draft against the guesses the draft model read then:
        those the text kept stay in its cache; returns how many of its last positions to
        drop."""
        kept = 0
        for a, b in zip(self.fed, self.since[:-1]):  # (its last token is read again:
            if a != b:                                # the next guess follows from it)
                break
            kept += 1
        drop = len(self.fed) - kept
        self.backlog.extend(self.since[kept:])
        self.fed, self.since = [], []
        return drop


class DraftModel:
    """The draft model and the batch KV cache of the rows drafting with it."""

    def __init__(self, model, prefill_step: int = 512, cost: float = 0.0,
                 prefix: Optional[PrefixCache] = None):
        self.model = model
        self.cost = cost  # one pass, in target steps (`step_cost`): a draft's price
        self.prefill_step = max(1, prefill_step)
        self.prefix = prefix  # its prompt cache (None: every row prefills its prompt)
        self.rows: dict[int, DraftRow] = {}
        self.batch = Rows()          # its batch cache: a row per joined uid (rows.py)

    def row(self, uid: int, prompt: Sequence[int]) -> DraftRow:
        """A drafter for a sequence that joins with `prompt`."""
        self.leave(uid)
        r = self.rows[uid] = DraftRow(self, uid, backlog=list(prompt))
        return r

    def leave(self, uid: int) -> None:
        r = self.rows.pop(uid, None)
        if r is not None and r.joined:
            self.batch.leave(uid)

    def reset(self) -> None:
        self.rows.clear()
        self.batch.clear()

    def _join(self, rows: list) -> None:
        """The rows' texts but their last tokens read by the draft model, each from the
        longest prefix its prompt cache holds (in chunks; the state of the text kept
        there), then appended to the batch cache together (mlx-lm's merge: left-padded to
        the longest)."""
        singles = []
        for r in rows:
            text, r.backlog = r.backlog[:-1], r.backlog[-1:]
            hit = self.prefix.fetch("", text + r.backlog) if self.prefix and text else None
            cache = hit.cache if hit is not None else make_prompt_cache(self.model)
            start = hit.tokens if hit is not None else 0
            for at in range(start, len(text), self.prefill_step):
                self.model(mx.array([text[at:at + self.prefill_step]]), cache=cache)
                if at + self.prefill_step < len(text):  # (the last chunks: one read for all)
                    mx.eval([c.state for c in cache])
            if self.prefix is not None and len(text) > start:
                self.prefix.store("", text, cache)
            singles.append(cache)
        mx.eval([c.state for cache in singles for c in cache if c.keys is not None])
        self.batch.join([r.uid for r in rows],
                        [layers[0].merge(list(layers)) for layers in zip(*singles)])
        for r in rows:
            r.joined = True

    def draft(self, asks: dict[int, int]) -> dict[int, list[int]]:
        """Up to `asks[uid]` tokens for each sequence asked, in k batched passes (k the
        most asked) over every row of the batch cache; rows not asked draft too (their
        backlog read, their guesses dropped or kept as the text goes on), so the cache
        stays one batch."""
        k = max(asks.values(), default=0)
        if k <= 0:
            return {}
        joining = [r for u in asks if (r := self.rows.get(u)) is not None and not r.joined]
        if joining:
            self._join(joining)
        order, cache = self.batch.order, self.batch.cache
        rows = [self.rows[u] for u in order]
        drop = [r.settle() for r in rows]
        if any(drop):
            _keep_only(cache, drop)
        backlogs = [r.backlog for r in rows]
        width = max(len(b) for b in backlogs)
        if width == 0:  # (nothing new since the last draft: not a step's order)
            return {}
        inputs = mx.array([b + [0] * (width - len(b)) for b in backlogs])
        logits = self.batch.run([len(b) for b in backlogs],
                                lambda: self.model(inputs, cache=cache))
        # (a row not asked drafts with throwaway keys: its own key only moves when it
        # drafts, so a seeded row draws the same keys alone or in any batch)
        samplings = [r.sampling for r in rows]
        sampling = [i for i, rs in enumerate(samplings) if rs is not None]
        keys = rejection.keys([samplings[i] for i in sampling],
                              [order[i] in asks for i in sampling]) if sampling else None
        token, q = rejection.draft_tokens(samplings, logits[:, -1, :],
                                          keys[:, 0] if keys is not None else None)
        guesses, qs = [token], [q]
        for n in range(1, k):
            logits = self.model(token[:, None], cache=cache)
            token, q = rejection.draft_tokens(samplings, logits[:, -1, :],
                                              keys[:, n] if keys is not None else None)
            guesses.append(token)
            qs.append(q)
        out = mx.stack(guesses, axis=1).tolist()
        q = mx.stack(qs, axis=1) if sampling else None  # (sampling rows, k, vocab)
        j = 0
        for r, g in zip(rows, out):
            r.backlog, r.fed, r.since = [], g[:-1], []
            r.q = None
            if r.sampling is not None:
                r.q, j = q[j], j + 1
        return {u: g[:asks[u]] for u, g in zip(order, out) if u in asks}



def step_cost(draft, target, context: int = 64, reps: int = 5) -> float:
    """A one-token pass of `draft` over one of `target`, after a `context`-token prompt:
    the best of `reps` interleaved (the machine drifts). On a GPU a small model's step is
    mostly kernel launches, so a quantized copy of the target costs nearly what the target
    does (same layers, same launches), and on MLX's CPU backend quantized matrices are no
    faster than float32 ones: there a draft does not pay, and adaptive.py's `Pace` rests."""
    import time

    def timer(model):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(1, context + 1))]), cache=cache))

        def once() -> float:
            t = time.perf_counter()
            mx.eval(model(mx.array([[7]]), cache=cache))
            for c in cache:
                c.trim(1)
            return time.perf_counter() - t
        return once

    times = {"draft": [], "target": []}
    clocks = {"draft": timer(draft), "target": timer(target)}
    for _ in range(reps):
        for name, once in clocks.items():
            times[name].append(once())
    return min(times["draft"]) / max(1e-9, min(times["target"]))
