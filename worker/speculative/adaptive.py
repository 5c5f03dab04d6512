"""Which sequences speculate, how far, and what it earned.

`Speculation` is what the batch attaches to mlx-lm's generation batch
(worker/speculative/verify.py): one `Track` per speculating sequence (its drafter and
its `Pace`), the running totals `/metrics` and `mlxctl status` show, and the counts each
request reports (Predicted Outputs' accepted and rejected prediction tokens).

`Pace` adapts a sequence's draft length to its acceptance: a draft accepted whole
doubles the next (up to `max_draft`); one cut short proposes one more than was accepted.
A verification step costs more than a plain one (the forward pass reads more positions,
and it cannot be overlapped with the next step: worker/speculative/verify.py; how much
more is timed on the device when the worker loads: cost.py `verify_price`), so a
sequence whose accepted tokens do not pay for it stops drafting for a while (doubling
each time, up to `MAX_REST` steps) and tries again (a prediction sooner: once the output
is back on the client's text, `Track.wants`); and a step verifies only when some
sequence's drafter has a guess for the text so far (`Drafter.ready`), so a step where
none does is mlx-lm's own pipelined step: prose that does not repeat its prompt decodes
as if nothing speculated. A sequence with a grammar drafts the tokens its grammar
forces, pace or no pace (they are kept unless the model tokenizes the same bytes another
way), and its drafter's guesses cut to what the grammar allows (`Track.grammar`:
worker/speculative/grammar.py).

A verification is the whole batch's step: every row waits for it, drafting or not, so in
a batch of n rows it costs n times what it costs one (a small model's step on a GPU is
its launches, the same for one row or eight). So a batch of several rows has its own
rest (`Gate`): it verifies only while the tokens its rows' drafts earn together pay for
that; otherwise every row decodes plainly, and the rows' probes, which would each cost
the batch a verification on its own, wait for the batch's rest to end and go together
(prose at 8 streams on a lent H200, each row resting and trying again on its own: 0.89 x
without speculation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.speculative import rejection

# A sequence rests when its average accepted tokens per verification falls below what a
# verification step costs over a plain one, in tokens: measured on the device at load
# (cost.py `verify_price`: `Pace.verify`), this where it is not (a recurrent model) and
# as the least a measured price may be. `python -m bench.speculative --step-cost` on the
# demo model (CPU, OpenBLAS) measured the forward pass verifying a draft of 1, 2, 4, 8
# tokens at 0.99, 1.25, 1.17, 1.36 x a one-token step (docs/benchmarks.md); on a lent
# H200 at 1.79-1.86 x.
MIN_GAIN = 0.4
MAX_REST = 64
RESYNC = 3   # tokens a prediction's output must agree with it again to end a rest
_EMA = 0.5


def price(verify: tuple | None, max_draft: int, drafted: int) -> float:
    """Tokens a verification of `drafted` tokens must earn, given what one of a single
    token and one of `max_draft` must (`verify`, cost.py `verify_price`; None: MIN_GAIN),
    between them by length."""
    if verify is None:
        return MIN_GAIN
    one, most = verify
    if max_draft <= 1:
        return one
    return one + (most - one) * (min(drafted, max_draft) - 1) / (max_draft - 1)


@dataclass
class Pace:
    max_draft: int
    length: int = 0
    gain: float = 1.0     # accepted tokens per verification, recent average
    rest: int = 0         # plain steps left before drafting again
    backoff: int = 4
    cost: float = 0.0     # drafting one token, in target steps (a draft model's passes)
    # What verifying a draft of one token and of `max_draft` must earn, in tokens
    # (cost.py `verify_price`, between them by length); None: MIN_GAIN.
    verify: tuple | None = None

    def __post_init__(self):
        self.length = min(4, self.max_draft)

    def price(self, drafted: int) -> float:
        """Tokens a verification of `drafted` tokens must earn to pay for its step."""
        return price(self.verify, self.max_draft, drafted)

    def wants(self) -> bool:
        return self.rest == 0

    def plain_step(self) -> None:
        if self.rest:
            self.rest -= 1

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.gain = (1 - _EMA) * self.gain + _EMA * accepted
        if accepted == drafted:
            self.length = min(self.max_draft, self.length * 2)
        else:
            self.length = max(1, accepted + 1)
        need = self.price(drafted)
        if self.gain < need + self.cost * drafted:  # (what the draft cost to make)
            self.rest, self.backoff = self.backoff, min(MAX_REST, self.backoff * 2)
            self.gain = need  # (a fresh chance after the rest)
        elif accepted:
            self.backoff = 4


@dataclass
class Gate:
    """A batch of several rows: whether it verifies at all (see the module's docstring).
    `update` after each verify step with what its rows' drafts earned together against
    what the step cost the batch, in tokens; a batch whose recent steps earn less rests
    (doubling each time, up to MAX_REST plain steps) and tries again with every row that
    is ready then."""
    gain: float = 1.0     # earned / cost over the recent verify steps
    rest: int = 0         # plain steps left before the batch verifies again
    backoff: int = 4

    def update(self, earned: float, cost: float) -> None:
        ratio = earned / cost if cost > 0 else 1.0
        self.gain = (1 - _EMA) * self.gain + _EMA * ratio
        if self.gain < 1.0:
            self.rest, self.backoff = self.backoff, min(MAX_REST, self.backoff * 2)
            self.gain = 1.0  # (a fresh chance after the rest)
        elif ratio >= 1.0:
            self.backoff = 4

    def plain_step(self) -> None:
        if self.rest:
            self.rest -= 1


@dataclass
class Track:
    """One speculating sequence."""
    drafter: object
    pace: Pace
    seq: object                  # the scheduler's Sequence: its counts go in its Done
    prediction: bool = False     # drafts from the client's prediction
    sampling: object = None      # its SamplingParams (rejection sampling: rejection.py)
    vocab: int = 0               # the target's vocabulary size (top_k's bound)
    grammar: object = None       # its GrammarDraft (grammar.py), if it has a grammar
    forced: bool = False         # its draft this step is what the grammar forces

    @property
    def bound(self) -> bool:
        """Its text depends on which steps it drafts at (a seeded sampler splits its key
        once a step, one position or several), so it keeps its own pace in any batch:
        a seed's text must not depend on the batch it lands in (`Gate`)."""
        s = self.sampling
        return s is not None and s.seed is not None and s.temperature != 0

    def wants(self) -> bool:
        """Whether it drafts at this step (its pace's rest over). A prediction's rest ends
        as soon as the output is back on the client's text by a whole n-gram: its
        departures are edits, and its drafts cost nothing to make (on the demo model's
        agent edit, resting through them took 49 steps for 200 tokens, 38 without)."""
        if self.pace.rest and self.prediction \
                and getattr(self.drafter, "synced", 0) >= RESYNC:
            self.pace.rest = 0
        return self.pace.wants()

    def forced_draft(self, pending: int, room: int) -> list[int]:
        """The tokens its grammar forces after `pending` (none: it has no grammar, or the
        grammar leaves a choice), drafted in place of its drafter's guess; `forced` says
        which this step's draft is."""
        self.forced = False
        if self.grammar is None:
            return []
        forced = self.grammar.forced(pending, min(room, self.pace.max_draft))
        if forced:  # (not the drafter's: its pace neither earns nor pays for it)
            self.forced = True
            self.pace.plain_step()
        return forced


@dataclass
class Totals:
    verifications: int = 0   # sequence-steps that verified a draft
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"verifications": self.verifications, "drafted": self.drafted,
                "accepted": self.accepted}


@dataclass
class Speculation:
    tracks: dict = field(default_factory=dict)   # uid -> Track
    totals: Totals = field(default_factory=Totals)
    gate: Gate = field(default_factory=Gate)     # a batch of several rows (Gate)
    # Whether a step none of whose sequences drafted still runs the verify forward (a
    # drafter that needs its hidden states: worker/speculative/mtp.py).
    always_verify = False
    # Drafts from a drafter with a distribution (a draft model, the MTP head) at
    # temperature > 0 are sampled and verified by rejection sampling (rejection.py);
    # off: drawn greedily and kept where the target's own sample matches.
    rejection = True
    # What a verification must earn on this device (cost.py `verify_price`, measured when
    # the worker loads: worker/loading/startup.py); None: MIN_GAIN. Each track's Pace.
    verify_price = None

    def forward(self, gb, inputs):
        """The verify step's logits of `inputs` (n, width) on the batch's caches."""
        return gb.model(inputs, cache=gb.prompt_cache)

    def nbytes(self) -> int:
        """KV bytes of its own that admission counts per token of the target's (the MTP
        head's cache: mtp.py); none here."""
        return 0

    def prompt_reader(self):
        """What prefills a prompt outside the batch (the warm prompt: worker/kvcache/
        warm.py) where the drafter keeps a state of the prompt beside the target's (the
        MTP head's: mtp_prefill.py `PromptReader`); None: the model alone, as here."""
        return None

    def add(self, uid: int, track: Track) -> None:
        self.tracks[uid] = track
        if self.rejection and hasattr(track.drafter, "sampling"):  # (it has a q)
            track.drafter.sampling = rejection.of(track.sampling, track.vocab)

    def sampled(self, uid: int, n: int):
        """(the sequence's RowSampling, its draft's q log-probabilities (n, vocab)) where
        its draft of `n` tokens was sampled; None: verified by greedy match."""
        t = self.tracks.get(uid)
        d = getattr(t, "drafter", None)
        rs, q = getattr(d, "sampling", None), getattr(d, "q", None)
        if not n or rs is None or q is None or t.forced:  # (forced: not drawn from q)
            return None
        return rs, q[:n]

    def drop(self, uid: int) -> None:
        t = self.tracks.pop(uid, None)
        close = getattr(t.drafter, "close", None) if t is not None else None
        if close is not None:  # (a draft model's row leaves its batch)
            close()

    def wants(self, uids) -> bool:
        """Whether this step verifies: some sequence is ready to draft and its drafter
        has a guess for the text so far (`Drafter.ready`, asked without the pending
        token, which is still being computed: a step where no sequence has one stays
        mlx-lm's pipelined step, at no extra cost), or its grammar forces tokens after
        the pending one (`GrammarDraft.ahead`); in a batch of several rows, not while the
        batch rests (`Gate`), unless a prediction is back on the client's text (its
        drafts are long and nearly all kept: `Track.wants`)."""
        resting = self.resting(uids)
        return any((t := self.tracks.get(uid)) is not None and (t.bound or not resting)
                   and (t.wants() and t.drafter.ready()
                        or t.grammar is not None and t.grammar.ahead()) for uid in uids)

    def resting(self, uids) -> bool:
        """Whether this batch rests from drafting (`Gate`; a batch of one row: its
        Pace); a prediction back on the client's text ends the rest (its drafts are long
        and nearly all kept: `Track.wants`)."""
        return self.gate.rest > 0 and len(uids) > 1 and not any(
            (t := self.tracks.get(uid)) is not None and t.prediction
            and getattr(t.drafter, "synced", 0) >= RESYNC for uid in uids)

    def propose(self, uid: int, pending: int, room: int, resting: bool = False) -> list[int]:
        """The pending token joins the sequence's text; its draft (none for a sequence
        not speculating now, nor while its batch is `resting` unless it is `bound`)."""
        t = self.tracks.get(uid)
        if t is None:
            return []
        t.drafter.extend([pending])
        if resting and not t.bound:
            t.pace.plain_step()
            return []
        if (forced := t.forced_draft(pending, room)):
            return forced
        if not t.wants() or room <= 0:
            t.pace.plain_step()
            return []
        draft = t.drafter.propose(min(room, t.pace.length))
        if t.grammar is not None:
            draft = t.grammar.valid(pending, draft)
        if not draft:  # a step verified for nothing: as costly as a draft rejected
            t.pace.update(1, 0)
        return draft

    def propose_all(self, uids, pending, rooms) -> list[list[int]]:
        """`propose` for every sequence of the batch; drafters that share a draft model
        (worker/speculative/draft_model.py) draft together, in one batched call, once
        every sequence's pending token has joined its text."""
        asks = {}  # draft model -> {uid: tokens wanted}
        drafts = []
        resting = self.resting(uids)
        for uid, p, room in zip(uids, pending, rooms):
            group = getattr(self.tracks.get(uid), "drafter", None)
            group = getattr(group, "group", None)
            if group is None:
                drafts.append(self.propose(uid, p, room, resting))
                continue
            t = self.tracks[uid]
            t.drafter.extend([p])
            if resting and not t.bound:
                t.pace.plain_step()
                drafts.append([])
            elif (forced := t.forced_draft(p, room)):
                drafts.append(forced)
            elif not t.wants() or room <= 0:
                t.pace.plain_step()
                drafts.append([])
            else:
                asks.setdefault(group, {})[uid] = min(room, t.pace.length)
                drafts.append(uid)  # (filled below)
        got = {}
        for group, ask in asks.items():
            got.update(group.draft(ask))
        for uid, p in zip(uids, pending):
            t = self.tracks.get(uid)
            if uid in got and t.grammar is not None:
                got[uid] = t.grammar.valid(p, got[uid])
                if not got[uid]:  # (cut to nothing: the draft's passes bought nothing)
                    t.pace.update(1, 0)
        return [got.get(d, []) if isinstance(d, int) else d for d in drafts]

    def verified(self, uid: int, draft: list, accepted: int, tokens: list,
                 following: int | None = None) -> None:
        """`accepted` tokens of `draft` were kept (the pending token's successors in
        `tokens`); `following`: the token sampled after them (None: the sequence ended)."""
        t = self.tracks.get(uid)
        if t is None:
            return
        if tokens:
            t.drafter.extend(tokens)
        if not draft:
            return
        if t.grammar is not None:  # (its mask consumed the whole draft: verify.py)
            t.grammar.rollback(len(draft) - accepted)
        self.totals.verifications += 1
        self.totals.drafted += len(draft)
        self.totals.accepted += accepted
        if t.forced:
            return
        t.pace.update(len(draft), accepted)
        if not t.prediction:
            return
        seq = t.seq
        seq.draft_accepted = getattr(seq, "draft_accepted", 0) + accepted
        seq.draft_rejected = getattr(seq, "draft_rejected", 0) + len(draft) - accepted

    def batch_verified(self, uids, drafts, earned: int) -> None:
        """A verify step of these rows, `drafts` theirs, kept `earned` drafted tokens in
        all: what it cost the batch is what each of its n rows would have decoded
        plainly in that time, n x the price of its longest draft (the rows' own
        `Pace.price`, with what the longest draft model's draft cost to make)."""
        if len(uids) < 2:  # (one row: its own Pace is the batch's)
            return
        longest, making = None, 0.0
        for uid, d in zip(uids, drafts):
            t = self.tracks.get(uid)
            if t is not None and d:
                making = max(making, t.pace.cost * len(d))
                if longest is None or len(d) > len(longest[1]):
                    longest = (t.pace, d)
        if longest is not None:
            pace, draft = longest
            self.gate.update(earned, len(uids) * (pace.price(len(draft)) + making))

    def attached(self, generator) -> None:
        """It speculates in `generator` (a BatchGenerator: the MTP head also reads its
        prompts, worker/speculative/mtp_prefill.py)."""

    def stepped(self) -> None:
        """A verify step has `verified` every row (the MTP head drafts for all of them in
        one pass: worker/speculative/mtp.py)."""

    def reported(self, responses, fed: bool = False) -> None:
        """A plain step's tokens (mlx-lm's own step): the drafters follow the text
        (`fed`: `propose` already gave them these tokens and counted the step)."""
        self.gate.plain_step()
        if fed:
            return
        for r in responses:
            t = self.tracks.get(r.uid)
            if t is not None:
                t.drafter.extend([r.token])
                t.pace.plain_step()

