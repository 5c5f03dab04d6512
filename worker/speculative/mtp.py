"""The checkpoint's own multi-token-prediction head as a drafter (`--speculative mtp`).

Qwen3.5/3.6 checkpoints ship an MTP block beside the model (`mtp.*` weights, config key
`mtp_num_hidden_layers`) that mlx-lm drops on load. Given the target's last hidden state
at position t (after its final norm) and the embedding of the token at t+1, it predicts
the token at t+2: `fc([norm_e(embed(x[t+1])), norm_h(h[t])])`, one full-attention
decoder layer with its own KV cache over the positions before, a norm, and the target's
own LM head. Its draft costs one small layer, not a second model.

Why not mlx-vlm's `Qwen3_5MTPDraftModel`: its decoder layer is mlx-vlm's (another
attention signature), and its state is one batch whose rows are the rounds of its own
generate loop; here sequences join and leave mlx-lm's batch at any step. So the head's
cache is mlxd's own batch (`MTPSpeculation`: one mlx-lm BatchKVCache per head layer, a
row per sequence drafting with it, kept by its `MTPDrafter`: rows.py, as a draft
model's rows are kept), and the layer is mlx-lm's `DecoderLayer` of the same family as the
target (the weights load by the same names). The weights are read from the
checkpoint's safetensors by their `mtp.` names (worker/loading/mtp_head.py).

The head reads the prompt, as vLLM's and mlx-vlm's MTP do (for an agent's edit the
prompt is where its drafts come from): while a sequence is prefilled, each chunk's final
hidden states go into its own head cache, one pass of the head per chunk as wide as the
target's (`prefilled`, from mtp_prefill.py, which runs the prompt batch's target as body
and LM head); the step that reads the prompt's last token and samples the first one
hands the head the last positions, and the sequence's row joins the head's batch with
its whole prompt (`started`: its first draft is made then, so its first verify step
already has one). A prompt resumed from the prefix cache or a snapshot resumes the head
too: the KV cache keeps the head's state beside the target's (`state_of`, `resumed`:
mtp_state.py; the pinned --warm-prompt's is read by `prompt_reader`, as the batch reads
a prompt: mtp_prefill.py); where an entry has none (trimmed to a shorter prefix), the
head reads only the new part, its cache starting at the first position prefilled, as it
does for an image's prompt after its last image (mlx-vlm prefills that part: worker/
vision/batch.py).

Inside the batch (worker/speculative/verify.py) the verify forward runs the target's body
and head as two calls (`MTPSpeculation.forward`): the same computation as the model's own
call, whose hidden states are then at hand for every row at no second forward. As the
step accepts each row's tokens (`verified`), the row's kept positions' hidden states and
the tokens that followed them (the accepted drafts and the token sampled next) are noted;
once every row is verified (`stepped`), ONE pass of the head reads all rows' new
positions (right-padded to the longest, the padding rolled into the left padding after:
rows.py), appending them to each row's cache, and each chained draft
token is one more pass for all rows, where some sequence's pace asks for more than one
token (greedy, or at temperature > 0 sampled from the head's distribution under each
sequence's sampling chain, with its own keys, for verify.py's rejection sampling:
rejection.py). So a step reads the head's layer and the LM head once per pass whatever
the number of rows: measured with `python -m bench.speculative --mtp` (docs/
benchmarks.md). The chain's speculative positions are trimmed off every row at the next
step, so a rejected guess leaves no trace in the head's cache; the drafts are evaluated
with the next step's first ask. A row whose sequence left (finished, cancelled, a failed
step's reset) is filtered out; a sequence joins the cache the first step it drafts. A
step where the row took no hidden state (a plain mlx-lm step while every sequence
rested) leaves a gap: it drafts again after one verify step without a draft.

Admission (worker/loop/batch.py `holds`) counts every row of the target's batch cache as
long as the longest row's reservation (its prompt and token budget); the head's cache is
counted the same way (`MTPHead.count_in`). Each pass grows every row of it by the widest
row's new positions (a narrower row's padding rolled left and kept, as the target's
batch cache keeps it: verify.py), so the rows are laid out again (`_compact`, decided on
the host from each row's `length`) where the cache would pass that reservation, or where
its padding passes half the longest row (every row attends over the whole length); past
the reservation it holds at most one pass's positions, which admission counts per
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.speculative import mtp_state, rejection
from worker.speculative.adaptive import Speculation
from worker.speculative.mtp_prefill import Prefill, PromptReader
from worker.speculative.rows import Rows

# A chained draft (the head fed its own output) degrades fast: mlx-vlm drafts
# mtp_num_hidden_layers + 1 tokens a round by default.
MAX_DRAFT = 3
# The rows of the head's batch cache are laid out again (`_compact`) where its length
# passes the longest row's by more than COMPACT_AT of that (every row attends over the
# whole length), or would pass what admission counts for the longest row's reservation.
COMPACT_AT = 0.5


def text_model(model):
    """mlx-lm's text model inside `model` (a Qwen3.5 checkpoint loads as a wrapper with
    `language_model`)."""
    return getattr(model, "language_model", model)


def body_and_head(model):
    """(the target's body: tokens -> final-norm hidden states, its LM head)."""
    lm = text_model(model)
    head = getattr(lm, "lm_head", None)
    if getattr(lm.args, "tie_word_embeddings", False) or head is None:
        head = lm.model.embed_tokens.as_linear
    return lm.model, head


class MTPHead(nn.Module):
    """Qwen3.5's MTP block (module doc); its layers are the target family's own."""

    def __init__(self, args, layers: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        size, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        # (A full-attention layer: the index of the family's first attention layer.)
        self.layers = [DecoderLayer(args, args.full_attention_interval - 1)
                       for _ in range(layers)]
        self.norm = nn.RMSNorm(size, eps=eps)

    def count_in(self, kv, max_draft: int) -> None:
        """Admission (worker/loop/batch.py `holds`) counts each sequence's head cache in
        `kv` (a KVSize): a position for each of its row of the target's (`per_token`),
        and past those what one pass of the head may add to every row beyond the longest
        row's reservation (`per_sequence`: a verify step's kept tokens and the one
        sampled after, up to the draft and one, and the chain's guesses), within which
        `MTPSpeculation._compact` keeps the rest of its padding."""
        per = self.kv_per_token()
        kv.per_token += per
        kv.per_sequence += int(per * (max_draft + MAX_DRAFT))

    def kv_per_token(self) -> float:
        """Bytes a sequence's head cache holds per token."""
        cache = [KVCache() for _ in self.layers]
        h = mx.zeros((1, 1, self.norm.weight.shape[0]), dtype=self.norm.weight.dtype)
        self(h, h, cache)
        mx.eval([c.state for c in cache])
        return sum((c.keys.nbytes + c.values.nbytes) / c.keys.shape[2] for c in cache)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list) -> mx.array:
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class MTPDrafter:
    """One sequence's MTP state: its next draft (computed, lazily, with every other row's
    by `MTPSpeculation`'s batched pass as soon as a verify step has the hidden states and
    the token that follows them); its head cache is a row of that batch cache."""

    def __init__(self, owner: "MTPSpeculation", reserved: int = 0):
        self.owner = owner
        self.reserved = reserved  # the KV tokens admission reserved for it (batch.py)
        self.joined = False     # a row of the owner's head cache
        self.length = 0         # positions its head cache holds (its row's, once joined)
        self.prompt = None      # its head cache while its prompt is prefilled (a KVCache
                                # per head layer, joined to the batch's when it starts)
        self.last = None        # (1, 1, hidden) the target's hidden state at the last
                                # prompt position read, whose next token the head awaits
        self.start = 0          # the position its head cache starts at (past 0: resumed
                                # without the head's state: mtp_state.py)
        self.tail = None        # (hidden states, row, index) of the last position read
        self.final = None       # (hidden states, row, tokens): the verify step it ended
                                # in kept `tokens`, which its head has not read
        self.guess = None       # (k,) the draft that follows the pending token
        self.sampling = None    # rejection.RowSampling: it samples the draft (None: greedy)
        self.q = None           # that draft's q log-probabilities (k, vocab), if sampled

    def extend(self, tokens) -> None:
        pass  # (the head reads the tokens with their hidden states: `observe`)

    def ready(self) -> bool:
        return True  # (a step without a guess verifies to compute one)

    def forget(self) -> None:
        self.guess = None

    def propose(self, k: int) -> list[int]:
        if self.guess is None or k <= 0:
            return []
        guess, self.guess = self.guess, None
        return guess[:k].tolist()

    def close(self) -> None:
        self.owner.leave(self)


@dataclass
class _New:
    """A row's new positions for the head's pass: `n` of them, then a draft of `k`."""
    n: int
    k: int
    row: int = 0         # (a verify step's: its row of the step's hidden states...
    tokens: list = None  # ...the tokens it kept, then the one it sampled next)
    hidden: object = None  # (a start's: its hidden states (1, n, H) and the tokens
    ids: object = None     # after them (1, n), as arrays: the first is not read yet)


class MTPSpeculation(Speculation):
    """Speculation whose verify forward also keeps the target's hidden states for the
    sequences drafting with the MTP head, and the head's batch cache: one row (one
    BatchKVCache per head layer, mlx-lm's) per sequence drafting with it, in `order`."""

    always_verify = True  # (a step without drafts still gives the hidden states)

    def __init__(self, model, head: MTPHead):
        super().__init__()
        self.body, self.lm_head = body_and_head(model)
        self.embed = self.body.embed_tokens
        self.head = head
        self.hidden = None
        self.rows: dict = {}      # uid -> its row of the verify step (of `hidden`)
        self.seen: dict = {}      # MTPDrafter -> (its verify row, tokens, draft length)
        self.batch = Rows()       # the head's batch cache: a row per joined MTPDrafter
        self.chained = 0          # speculative positions the last chain left in it
        self.lazy: list = []

    def drafter(self, reserved: int = 0) -> MTPDrafter:
        return MTPDrafter(self, reserved)

    def nbytes(self) -> int:  # (the head's batch cache and those of prompts it reads)
        return self.batch.nbytes + sum(c.nbytes for t in self.tracks.values()
                                       for c in getattr(t.drafter, "prompt", None) or ())

    def state_of(self, uid: int, tokens: int) -> list | None:
        """The head's state beside the target's state of the sequence's first `tokens`
        tokens, for the KV cache to keep with it (None: its head holds not exactly that:
        mtp_state.py)."""
        t = self.tracks.get(uid)
        d = t.drafter if t is not None else None
        return mtp_state.state_of(self, d, tokens) if isinstance(d, MTPDrafter) else None

    def resumed(self, uid: int, cached: int, head: list | None) -> None:
        """The sequence starts from the KV cache's state of its first `cached` prompt
        tokens, with the head's beside it (`head`; None: its head reads what follows)."""
        for _, d, _ in self._drafters([uid]):
            mtp_state.restore(d, cached, head, len(self.head.layers))

    def prompt_reader(self) -> PromptReader:
        """The warm prompt (worker/kvcache/warm.py) prefilled as the batch prefills a
        prompt drafting with the head, its head's state kept beside it."""
        return PromptReader(self)

    def attached(self, generator) -> None:
        """The generator's prompt batch runs the target through `Prefill`, which keeps
        its hidden states for the head (mtp_prefill.py)."""
        generator._prompt_batch.model = Prefill(generator._prompt_batch.model, self)

    def _drafters(self, uids) -> list:
        """(index, MTPDrafter, the draft length its pace asks) of each of `uids` that
        drafts with the head."""
        out = []
        for i, uid in enumerate(uids):
            t = self.tracks.get(uid)
            if t is not None and isinstance(t.drafter, MTPDrafter):
                out.append((i, t.drafter, max(1, min(t.pace.length, MAX_DRAFT))))
        return out

    def prefilled(self, uids: list, tokens: list, hidden: mx.array) -> list:
        """A prompt chunk of these rows ran (`tokens[i]`: row i's, `hidden` (rows, width,
        H) their final hidden states, right-padded): each MTP sequence's head reads its
        positions, each hidden state with the token after it (the chunk's last waits
        for the next chunk's first token: `last`), into its own head cache, one pass per
        row. Returns the arrays to evaluate with the chunk."""
        out = []
        for i, d, _ in self._drafters(uids):
            if tokens[i]:
                out += self.read(d, tokens[i], hidden[i:i + 1, :len(tokens[i])])
        return out

    def read(self, d: MTPDrafter, ids: list, h: mx.array) -> list:
        """`d`'s head reads a prompt chunk `ids` whose final hidden states are `h` (1,
        len(ids), H) into its own head cache (`prefilled`, for a row of the batch; the
        warm prompt's reader: mtp_prefill.py `PromptReader`). The arrays to evaluate."""
        out = []
        if d.last is not None:
            h, d.last = mx.concatenate([d.last, h], axis=1), h[:, -1:]
            read, h = ids, h[:, :-1]
        else:
            read, h, d.last = ids[1:], h[:, :-1], h[:, -1:]
        if read:
            if d.prompt is None:
                d.prompt = [KVCache() for _ in self.head.layers]
            self.head(self.embed(mx.array([read])), h, d.prompt)
            d.length += len(read)
            out += [c.state for c in d.prompt]
        out.append(d.last)
        return out

    def started(self, uids: list, last: list, hidden: mx.array, first: mx.array) -> None:
        """These rows' prompts are read but their last tokens `last`, which the target
        just read (`hidden` (rows, 1, H)) to sample each row's first token `first`
        (lazy: not read back here): the head reads each prompt's last two positions (the
        hidden state before the last token with it, the last one's with the first
        token), and drafts, so the first verify step of a sequence has a draft made over
        its whole prompt. One pass of the head for these rows."""
        seen = {}
        for i, d, k in self._drafters(uids):
            ids = mx.concatenate([mx.array([last[i]], dtype=first.dtype), first[i:i + 1]])
            h = hidden[i:i + 1]
            if d.last is not None:
                h, ids = mx.concatenate([d.last, h], axis=1), ids[None]
            else:
                ids = ids[None, 1:]
            d.last = None
            seen[d] = _New(ids.shape[1], k, hidden=h, ids=ids)
        if seen:
            self.lazy += self._draft(seen)
            mx.async_eval(self.lazy)

    def forward(self, gb, inputs):
        self.hidden = self.body(inputs, cache=gb.prompt_cache)
        self.rows = {uid: i for i, uid in enumerate(gb.uids)}
        return self.lm_head(self.hidden)

    def propose(self, uid: int, pending: int, room: int, resting: bool = False) -> list[int]:
        if self.lazy:  # (every row's draft in one evaluation)
            mx.eval(self.lazy)
            self.lazy = []
        t = self.tracks.get(uid)
        if t is not None and isinstance(t.drafter, MTPDrafter) and not resting \
                and t.drafter.guess is None and t.pace.wants():
            # (No hidden state yet: this step takes one, unpenalized; a grammar's forced
            # tokens are drafted all the same.)
            return t.forced_draft(pending, room)
        return super().propose(uid, pending, room, resting)

    def verified(self, uid: int, draft: list, accepted: int, tokens: list,
                 following: int | None = None) -> None:
        """The row kept the pending token and `tokens` (their hidden states are at its
        row of the verify forward), then sampled `following`: the head reads them (each
        hidden state with the token after it) in `stepped`, with every other row's."""
        super().verified(uid, draft, accepted, tokens)
        for _, d, k in self._drafters([uid]):
            if uid not in self.rows:
                continue
            if following is None:  # (it ended: what it kept, for its state: mtp_state.py)
                d.final = (self.hidden, self.rows[uid], list(tokens))
                continue
            read = list(tokens) + [following]
            self.seen[d] = _New(len(read), k, row=self.rows[uid], tokens=read)

    def stepped(self) -> None:
        """Every row of the verify step is verified: one batched pass of the head over
        all their new positions, then each chained draft token in one pass for all."""
        seen, self.seen = self.seen, {}
        if seen:
            self.lazy += self._draft(seen)
            mx.async_eval(self.lazy)

    def reported(self, responses, fed: bool = False) -> None:
        super().reported(responses, fed)
        for r in responses:  # (a plain step: no hidden state for these tokens)
            t = self.tracks.get(r.uid)
            if t is not None and isinstance(t.drafter, MTPDrafter):
                t.drafter.forget()
                t.drafter.tail = None  # (its head's cache now skips a position)

    def leave(self, drafter: MTPDrafter) -> None:
        if drafter in self.batch:
            self._keep([d for d in self.batch.order if d is not drafter])

    def _keep(self, drafters: list) -> None:
        """Only these rows stay in the head cache (in their order)."""
        for d in self.batch.order:
            if d not in drafters:
                d.joined = False
        self.batch.keep(drafters)
        if not self.batch:
            self.chained = 0

    def _draft(self, seen: dict) -> list:
        """The head's pass over every row's new positions (`seen`: drafter -> _New;
        right-padded to the longest, each row's last one read), its chain, and each seen
        row's draft: the arrays to evaluate. A row the batch dropped (a failed step's
        reset) leaves first; rows not seen read nothing (their padding rolled left:
        rows.py)."""
        live = {id(t.drafter) for t in self.tracks.values()}
        if any(id(d) not in live for d in self.batch.order):
            self._keep([d for d in self.batch.order if id(d) in live])
        if self.chained:  # (the last chain's guesses: never the text's)
            for c in self.batch.cache:
                c.trim(self.chained)
            self.chained = 0
        joining = [d for d in seen if not d.joined]
        if joining:
            self._join(joining)
        rows = self.batch.order
        lengths = [seen[d].n if d in seen else 0 for d in rows]
        count = max(s.k for s in seen.values())
        self._compact()
        cache = self.batch.cache
        tokens, hidden = self._inputs(seen, rows, max(lengths))
        h = self.batch.run(lengths, lambda: self.head(self.embed(tokens), hidden, cache))
        for d, s in seen.items():
            d.length += s.n
            d.tail = (s.hidden, 0, s.n - 1) if s.hidden is not None \
                else (self.hidden, s.row, s.n - 1)
        samplings = [d.sampling for d in rows]
        sampling = [i for i, s in enumerate(samplings) if s is not None]
        # (a row not seen drafts with throwaway keys: its own key moves only when it
        # drafts, so a seeded row draws the same keys alone or in any batch)
        keys = rejection.keys([samplings[i] for i in sampling],
                              [rows[i] in seen for i in sampling]) if sampling else None
        draft, qs = [], []
        for n in range(count):
            if n:
                h = self.head(self.embed(draft[-1][:, None]), h, cache)
                self.chained += 1
            token, q = rejection.draft_tokens(samplings, self.lm_head(h)[:, -1],
                                              keys[:, n] if keys is not None else None)
            draft.append(token)
            qs.append(q)
        guesses = mx.stack(draft, axis=1)
        q = mx.stack(qs, axis=1) if sampling else None  # (sampling rows, count, vocab)
        j = 0
        for i, d in enumerate(rows):
            if d in seen:
                k = seen[d].k
                d.guess = guesses[i, :k]
                d.q = q[j, :k] if d.sampling is not None else None
            j += d.sampling is not None
        return [guesses] + ([q] if q is not None else [])

    def _inputs(self, seen: dict, rows: list, width: int) -> tuple:
        """(tokens (rows, width), hidden states (rows, width, H)) of the pass: each seen
        row's new positions, right-padded; a verify step's rows gathered from its
        forward's hidden states in one take, a start's stacked from their own."""
        if not any(s.hidden is not None for s in seen.values()):
            tokens = mx.array([(seen[d].tokens if d in seen else [])
                               + [0] * (width - (seen[d].n if d in seen else 0))
                               for d in rows], dtype=mx.int32)
            at = mx.array([seen[d].row if d in seen else 0 for d in rows])
            return tokens, self.hidden[at, :width]
        like = next(iter(seen.values())).hidden
        tokens, hidden = [], []
        for d in rows:
            s = seen.get(d)
            if s is None:
                tokens.append(mx.zeros((1, width), mx.int32))
                hidden.append(mx.zeros((1, width, like.shape[-1]), like.dtype))
                continue
            pad = width - s.n
            tokens.append(mx.pad(s.ids.astype(mx.int32), [(0, 0), (0, pad)]))
            hidden.append(mx.pad(s.hidden, [(0, 0), (0, pad), (0, 0)]))
        return mx.concatenate(tokens), mx.concatenate(hidden)

    def _compact(self) -> bool:
        """Each row's positions laid out again, left-padded to the longest (rows.py),
        where the head cache (whose every pass grows every row by the widest row's new
        positions, a narrower row's padding rolled left) is longer than the longest row
        by more than COMPACT_AT of it, or than admission counts for each row (the KV of
        the longest row's reservation: batch.py `holds`; the pass that follows adds at
        most what `MTPHead.count_in` counts past it). Counted on the host (each row's
        `length`): no read from the device."""
        if not self.batch:
            return False
        rows = self.batch.order
        size = self.batch.cache[0]._idx
        longest = max(d.length for d in rows)
        step, reserved = BatchKVCache.step, max(d.reserved for d in rows)
        counted = -(-reserved // step) * step if reserved else None  # (None: not told)
        if size <= longest * (1 + COMPACT_AT) and (counted is None or size <= counted):
            return False
        self.batch.compact()
        return True

    def _join(self, drafters: list) -> None:
        """Rows for sequences that draft for the first time: their head caches (of their
        prompts, `prefilled`, else empty), left-padded to the others' length."""
        cache = [BatchKVCache.merge([d.prompt[i] if d.prompt is not None else KVCache()
                                     for d in drafters])
                 for i in range(len(self.head.layers))]
        self.batch.join(drafters, cache)
        for d in drafters:
            d.joined, d.prompt = True, None
