"""Continuous batching: every running sequence advances in one batched step.

Built on mlx-lm's `BatchGenerator` (its batched KV caches, chunked prefill, one step in
flight with `mx.async_eval`, per-sequence samplers, logits processors, stop tokens and
token budgets). New sequences join at step boundaries; each `step()` is one decode step
for the sequences generating and ONE prefill chunk (at most `prefill_batch` prompts ×
`prefill_step` tokens, or as many short prompts as that many tokens hold:
sizing.py `prompts_for_step`) for those being prefilled, so a long prompt never stalls
the streams already running for longer than one chunk.

What this module adds around it:
- admission against the KV budget by what the batch really holds (`Batch.holds`):
  mlx-lm's batch cache is one array per layer whose every row is as long as the longest
  (left padding) and grows 256 tokens at a time, so N sequences hold N times the KV of
  the longest prompt plus token budget (`KVSize`), not the sum of their own; a step also
  needs working memory (`StepMemory`: a prefill chunk's activations, the logits at the
  batch's width; a chunk may also borrow device memory to spare, `spare`: its
  activations last one step). One that would overflow what is running waits (FIFO: the
  scheduler admits in order and stops at the first that does not fit). The worker caps its
  context so that one sequence alone always fits (worker/loading/startup.py), so nothing waits
  forever;
- the KV cache (worker/kvcache/manager.py): a sequence starts from the state the cache
  manager answers for its prompt (a cached prefix, or the named snapshot it resumes
  from), and the batch hands the manager the states it asks for: at the prompt lengths
  it names (`checkpoints`: for caches that cannot be trimmed) and at the end of each
  sequence, with the MTP head's state beside it where the head has one (`_head`:
  worker/speculative/mtp_state.py), which a sequence resumed from it takes back;
- per-sequence output (worker/text/decoding.py), and removal on cancel, stop strings and
  grammar completion, which mlx-lm's batch does not know about.

A step that raises cannot be pinned on one sequence: the scheduler takes the sequences
back (`reset`, a fresh generator) and finds the culprit (worker/loop/scheduler.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from protocol.messages import CacheStats, KVStats, PromptCache, SpeculationStats
from worker.kvcache.manager import KVCache
from worker.kvcache.quantized import KVFormat
from worker.loop import cuda_attention, echo, mlx_lm_patches, warmup
from worker.loop.first_token import FirstToken, read_first
from worker.loop.sizing import (MIN_CHUNK, CacheRoom, ChunkSizer, KVSize, StepMemory,
                                prompts_for_step)
from worker.speculative import mtp, recurrent, verify
from worker.speculative.adaptive import Pace, Speculation, Track
from worker.speculative.drafters import NoGuess, Prediction, PromptLookup
from worker.speculative.grammar import GrammarDraft
from worker.text.decoding import Decoding

log = logging.getLogger("worker.loop.batch")


mlx_lm_patches.apply()
cuda_attention.install()
verify.install()


def materialized(cache: list) -> list:
    """`cache` computed now. A sequence's cache extracted from the batch is a lazy copy
    of its row (worker/loop/mlx_lm_patches.py): kept unevaluated, it would hold the whole batch's
    arrays alive, every layer of every row, while the prompt cache counts one row's
    bytes (a 24-token state of SmolLM2 held 69 MB, not 1.1)."""
    mx.eval([c.state for c in cache])
    return cache


@dataclass
class Member:
    """A sequence in the batch."""
    seq: Any                    # the scheduler's Sequence
    decoding: Decoding
    cache: PromptCache          # its request's KV cache options (namespace, names)
    tokens: int                 # KV tokens reserved: its prompt plus its token budget
    prompt: int                 # its prompt's tokens (what a prefill chunk may follow)
    checkpoints: list = field(default_factory=list)  # prompt lengths to keep the state at
    first_read: bool = False    # its first token was read early (first_token.py)
    key: Optional[list] = None  # its prompt as the KV cache knows it, where not its ids
    shares: bool = False        # others with its prompt wait for its state (Batch.waits)

    def keyed(self, tokens: list) -> list:
        """`tokens` (its prompt, then its output) as the KV cache knows them."""
        if self.key is None:
            return tokens
        return self.key[:len(tokens)] + tokens[len(self.key):]


class Batch:
    scores_prompts = True  # an echo's prompt logprobs can be computed (worker/loop/echo.py)
    shares_prompts = True  # one prefill of a prompt serves its repeats (`waits`)

    def __init__(self, engine, *, max_size: int, prefill_step: int, prefill_batch: int,
                 kv_budget: int, kvcache: Optional[KVCache], kv: KVSize,
                 max_kv_size: Optional[int] = None,
                 chunks: Optional[ChunkSizer] = None,
                 step_memory: Optional[StepMemory] = None,
                 kv_format: KVFormat = KVFormat(),
                 speculative: str = "none", max_draft: int = 8, mtp_head=None,
                 draft=None,
                 spare: Optional[Callable[[], int]] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.max_size = max(1, max_size)
        self.prefill_step = prefill_step
        self.prefill_batch = max(1, min(prefill_batch, self.max_size))
        self.kv_budget = kv_budget
        self.kvcache = kvcache   # None: no prompt cache
        self.kv = kv
        self.step_memory = step_memory or StepMemory(0.0, 0.0, 0)
        self.cache_room = CacheRoom()  # (its limit: worker/loading/startup.py bound_memory)
        self.max_kv_size = max_kv_size
        self.kv_format = kv_format  # (quantized: worker/kvcache/quantized.py)
        self.chunks = chunks or ChunkSizer(prefill_step, prefill_step)  # default: fixed
        self.spare = spare  # device memory a prefill chunk may borrow now (_fit_chunk)
        self._clock = clock
        self.members: dict[int, Member] = {}
        self.reserved = 0
        self._ended: list = []      # final states not stored yet (`settle`)
        self._held = False          # the caller settles after each step (`hold_stores`)
        # Speculative decoding (worker/speculative/): prompt lookup for every sequence
        # that may (`speculative`), a client's prediction whenever one comes; only where
        # the cache can give back rejected positions (KV caches, quantized or not, and
        # recurrent state: worker/speculative/recurrent.py; no rotating window: its
        # rows are not trimmed that way). `mtp_head`: --speculative mtp's (mtp.py).
        self.prompt_lookup = speculative == "prompt-lookup"
        self.draft = draft  # a draft model drafts instead (worker/speculative/draft_model.py)
        self.max_draft = max(0, max_draft)
        self.speculation = Speculation() if self.max_draft and max_kv_size is None \
            and recurrent.install(engine.model) else None
        if self.speculation is not None and mtp_head is not None:  # (--speculative mtp)
            self.speculation = mtp.MTPSpeculation(engine.model, mtp_head)
        self.gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.engine.model, stop_tokens=[[t] for t in self.engine.eos],
            completion_batch_size=self.max_size, prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.chunks.size, max_kv_size=self.max_kv_size,
            stream=generation_stream)
        if self.speculation is not None:
            self.speculation.tracks.clear()
            if self.draft is not None:
                self.draft.reset()
            verify.attach(gen, self.speculation)
        return gen

    def _set_chunk(self, size: int) -> None:
        """The prefill chunk of the next steps. BatchGenerator slices each prompt by its
        own size and its prompt batch runs the model by ITS size (set when the generator
        was made): both are set, so one step is one chunk."""
        self.gen.prefill_step_size = size
        self.gen._prompt_batch.prefill_step_size = size

    def __len__(self) -> int:
        return len(self.members)

    # ---- admission -------------------------------------------------------------------

    def tokens(self, prep) -> int:
        """The KV tokens `prep` may come to hold: its prompt plus its token budget."""
        return len(prep.ids) + self.engine.budget(prep)

    def need(self, prep) -> int:
        """`prep`'s own KV (what it holds alone, unpadded)."""
        return self.kv.of(self.tokens(prep))

    def holds(self, tokens: list[int]) -> int:
        """What the batch holds for sequences of these KV lengths: every row of mlx-lm's
        batch cache as long as the longest, grown BatchKVCache.step tokens at a time,
        and the logits of a step for each. (A prefill chunk's working memory is bounded
        by its size: `_fit_chunk`.)"""
        if not tokens:
            return 0
        step = BatchKVCache.step
        longest = -(-max(tokens) // step) * step
        return len(tokens) * self.kv.of(longest) + self.step_memory.decode(len(tokens))

    def fits(self, prep) -> bool:
        """Room for `prep` now: a free slot, and what the batch holds with it within the
        budget (a sequence alone always fits: the context is capped to the budget)."""
        running = self.running_tokens()
        if len(running) >= self.max_size:
            return False
        return not running or self.holds(running + [self.tokens(prep)]) <= self.kv_budget

    def running_tokens(self) -> list[int]:
        """The KV tokens each admitted sequence reserves."""
        return [m.tokens for m in self.members.values()]

    def _reserve(self) -> None:
        self.reserved = self.holds(self.running_tokens())

    def add(self, seq, prep) -> int:
        """Start `prep` (after `fits`); returns the prompt tokens the KV cache supplied."""
        if prep.gen.output.echo and prep.gen.output.logprobs:
            self.insert(seq, prep, self.scored(prep))
            return 0
        hit = self.cached_start(prep)
        self.insert(seq, prep, hit)
        return hit.tokens if hit is not None else 0

    def scored(self, prep):
        """An echo's prompt scored into a fresh cache of the batch's KV format
        (worker/loop/echo.py): the Start it leaves."""
        cache = self.new_cache() or make_prompt_cache(self.engine.model, self.max_kv_size)
        return echo.scored_start(self.engine, prep, cache)

    def cached_start(self, prep, least: Optional[int] = None):
        """The KV cache's starting state for `prep` (None: from scratch), none of fewer
        than `least` tokens: by default, on CUDA, a prompt chunk's bucket
        (mlx_lm_patches.BUCKET). Such a start (a chat template's header, which nearly
        every chat shares) is computed again in a pass at most a bucket wider than the
        one after it would be, and from nothing a prompt goes with others in a power of
        two rows and at a key count cuDNN's attention has met
        (worker/loop/cuda_attention.py)."""
        self.settle()  # (a state that just ended may be its prefix)
        if self.kvcache is None:
            return None
        least = mlx_lm_patches.BUCKET if least is None else least
        hit = self.kvcache.start(prep.gen.cache, self.cache_key(prep), prep.snapshot, least)
        prep.snapshot = None  # (host memory: not kept with a waiting request)
        return hit

    def insert(self, seq, prep, hit, began: Optional[int] = None) -> None:
        """`prep` into mlx-lm's batch from `hit` (a state holding its first `hit.tokens`
        prompt tokens; None: from scratch); `began`: where its prefill began, when that
        was before `hit` (an image prompt's images: worker/vision/batch.py)."""
        engine, ids, spec = self.engine, prep.ids, prep.gen.cache
        decoding = engine.decoding(prep)
        checkpoints = []  # prompt lengths to keep the state at
        cached = hit.tokens if hit is not None else 0
        key = self.cache_key(prep)
        if self.kvcache is not None:
            marks = (self.kvcache.branch(spec, key), *getattr(prep, "marks", ()))
            checkpoints = self.kvcache.checkpoints(cached, len(ids), marks, began,
                                                   prep.shared)
        bounds = [cached] + checkpoints + [len(ids)]
        segments = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
        processors = engine.processors(prep)
        if decoding.grammar is not None:
            processors.append(decoding.grammar)
        (uid,) = self.gen.insert_segments(
            segments=[segments], max_tokens=[decoding.budget],
            caches=[hit.cache if hit is not None else self.new_cache()],
            all_tokens=[ids[:cached]],
            samplers=[engine.sampler(prep)], logits_processors=[processors])
        self.members[uid] = Member(seq, decoding, spec, self.tokens(prep), len(ids),
                                   checkpoints, key=None if key is ids else key,
                                   shares=bool(checkpoints) and prep.shared)
        seq.uid = uid
        self._speculate(uid, seq, prep)
        if isinstance(self.speculation, mtp.MTPSpeculation):
            self.speculation.resumed(uid, cached, hit.head if hit is not None else None)
        self._reserve()
        self._bound_prefix()

    def cache_key(self, prep) -> list:
        """`prep`'s prompt as the KV cache knows it: its ids (a vision batch's also say
        which image each image token shows: worker/vision/batch.py)."""
        return prep.ids

    # ---- one prefill for a prompt's repeats (a request's `n` choices) -----------------
    # Choices of one prompt arrive together. Prefilled side by side, a long prompt costs
    # n times the compute (a prefill is compute-bound) and as many times the time to the
    # first token. Instead the first keeps the prompt's state when its prefill ends
    # (`same` says a repeat waits: the scheduler sets `prep.shared`), the repeats wait
    # for it (`waits`), and then start from it in the prefix cache: one token each.

    def same(self, prep, other) -> bool:
        """`other` repeats `prep`'s prompt (the same tokens in the same namespace), and
        the KV cache can hand it `prep`'s state."""
        return (self.kvcache is not None and not other.gen.output.echo
                and prep.gen.cache.namespace == other.gen.cache.namespace
                and self.cache_key(prep) == self.cache_key(other))

    def waits(self, prep) -> bool:
        """A sequence prefilling `prep`'s prompt will keep its state: `prep` starts from
        it once it has (a request's `n` choices: one prefill, not n)."""
        return any(m.shares and m.checkpoints and self.same(m.seq.prep, prep)
                   for m in self.members.values())

    def new_cache(self) -> Optional[list]:
        """A fresh cache for one sequence in the batch's KV format (None: mlx-lm's)."""
        return self.kv_format.make(self.engine.model, self.max_kv_size) \
            if self.kv_format.quantized else None

    def _speculate(self, uid: int, seq, prep) -> None:
        """A drafter for the sequence: the client's prediction, else prompt lookup where
        the model has it on. A sequence with a grammar drafts what it forces, and its
        drafter's guesses cut to what it allows (worker/speculative/grammar.py);
        penalties and logit_bias process each drafted position: verify.py."""
        if self.speculation is None:
            return
        grammar = self.members[uid].decoding.grammar
        predicted = getattr(prep, "prediction", None)
        if predicted:
            drafter = Prediction(predicted)
        elif self.draft is not None:
            drafter = self.draft.row(uid, prep.ids)
        elif self.prompt_lookup:
            drafter = PromptLookup(prep.ids)
        elif isinstance(self.speculation, mtp.MTPSpeculation):
            drafter = self.speculation.drafter(self.members[uid].tokens)
        elif grammar is not None:  # (its forced tokens only)
            drafter = NoGuess()
        else:
            return
        pace = Pace(self.max_draft, cost=getattr(drafter, "cost", 0.0),
                    verify=self.speculation.verify_price)
        self.speculation.add(uid, Track(drafter, pace, seq, prediction=bool(predicted),
                                        sampling=prep.gen.sampling,
                                        vocab=self.engine.vocab_size,
                                        grammar=grammar and GrammarDraft(grammar)))

    def _fit_chunk(self) -> None:
        """The next prefill chunk within the memory the running sequences leave: halved
        from the size its speed allows (ChunkSizer) until the chunk of the prompts the
        step prefills fits, however long they are (MIN_CHUNK at least, so a prompt always
        advances). Its working memory is gone once the step ends (mlx-lm returns the
        buffers after each chunk), so besides what the KV budget leaves it may use what
        the device has spare (`spare`: none where the device says nothing of it); the
        prompt cache gives way only for what the budget must supply. Not measured (a
        worker group's rank: every rank must step the chunk the leader's timing chose),
        nothing to fit."""
        if not self.members or not (self.step_memory.per_token or self.step_memory.per_pair):
            return
        gen = self.gen
        waiting = len(gen._prompt_batch) + len(gen._unprocessed_sequences)
        if not waiting:
            self.cache_room.decoding()
            return  # only decoding: no chunk, and the prompt cache keeps its room
        self.cache_room.prefilling()
        rows = min(gen.prefill_batch_size, waiting)  # (the prompts this step prefills)
        room = self.kv_budget - self.reserved
        # A chunk attends to at most its prompt's tokens: the longest prompt's last chunk.
        longest = max(m.prompt for m in self.members.values())

        def need(chunk: int) -> int:
            tokens = min(chunk, longest)
            return self.step_memory.prefill(rows, tokens, longest - tokens)

        chunk = self.chunks.size
        spare = self.spare() if self.spare is not None and need(chunk) > room else 0
        while chunk > MIN_CHUNK and need(chunk) > room + spare:
            chunk = max(MIN_CHUNK, chunk // 2)
        if chunk != gen.prefill_step_size:
            self._set_chunk(chunk)
        if self.kvcache is not None:
            self.kvcache.trim_to(room - max(0, need(chunk) - spare))

    def _bound_prefix(self) -> None:
        """The prefix cache gives way to what the running sequences hold: together they
        stay within the KV budget."""
        if self.kvcache is not None:
            self.kvcache.trim_to(self.kv_budget - self.reserved)

    # ---- stepping --------------------------------------------------------------------

    def step(self) -> list:
        """One batched step: [(seq, outcome)] for each sequence that produced a token,
        where outcome is `Decoding.feed`'s tuple or the exception it raised (the
        sequence is then out of the batch). Raises if the step itself failed."""
        self.settle()
        gen = self.gen
        if gen._unprocessed_sequences:  # (short prompts together: sizing.py)
            gen.prefill_batch_size = prompts_for_step(gen, self.chunks.size,
                                                      self.prefill_batch, self.max_size)
        self._fit_chunk()
        t0 = self._clock()
        prompt_responses, token_responses = gen.next()
        if self.kv_format.start and self.kv_format.quantized:  # --quantized-kv-start
            # (worker/kvcache/quantized.py), a row alone on plain views back first
            lone = mlx_lm_patches.lone_tokens(gen._generation_batch)
            if lone is not None and lone > self.kv_format.start:
                mlx_lm_patches.as_batch(gen._generation_batch)
            self.kv_format.pass_start(gen)
        if any(not r.end_of_prompt for r in prompt_responses):  # it prefilled a chunk:
            size = self.chunks.size                            # size the next by its time
            if self.chunks.observe(self._clock() - t0) != size:
                self._set_chunk(self.chunks.size)
        for r in prompt_responses:
            if r.end_of_segment and not r.end_of_prompt:
                self._checkpoint(r.uid)
        results = []
        first = self._first_tokens([r.uid for r in prompt_responses if r.end_of_prompt])
        for r in first + list(token_responses):
            m = self.members.get(r.uid)
            if m is None:
                continue
            if m.first_read and not isinstance(r, FirstToken):
                m.first_read = False   # mlx-lm's own report of the token already read
                if r.finish_reason is None:
                    continue
                # (It ended there by mlx-lm's rule, not by Decoding's: end it now.)
                self._store(r.uid, m, r.all_tokens, r.prompt_cache)
                self._leave(r.uid, in_gen=False, store=False)
                results.append((m.seq, (-1, "", r.finish_reason, None)))
                continue
            try:
                out = m.decoding.feed(r.token, r.logprobs)
            except Exception as e:
                self._leave(r.uid, r.finish_reason is None, store=False)
                results.append((m.seq, e))
                continue
            if out[2] is not None:  # finished
                m.seq.stop_sequence = m.decoding.stop_sequence
                if r.finish_reason is not None:  # mlx-lm ended it (EOS, length)
                    self._store(r.uid, m, r.all_tokens, r.prompt_cache)
                    self._leave(r.uid, in_gen=False, store=False)
                else:  # a stop string or a complete grammar: mlx-lm does not know
                    self._leave(r.uid, in_gen=True, store=True)
            results.append((m.seq, out))
        if not self._held:
            self.settle()
        return results

    def _first_tokens(self, joined: list[int]) -> list:
        """The first tokens of sequences that moved to decoding in this step, where they
        can be read now (worker/loop/first_token.py)."""
        return read_first(self.gen, self.members, joined)

    def _checkpoint(self, uid: int) -> None:
        """The end of a prompt segment: the KV cache keeps the state for later prompts."""
        m = self.members.get(uid)
        if m is None or self.kvcache is None or not m.checkpoints:
            return
        m.checkpoints.pop(0)
        self._keep_state(uid, m)

    def _keep_state(self, uid: int, m: Member) -> None:
        """The sequence's state as it stands (and the MTP head's beside it), for later
        prompts."""
        for cache, tokens in self.gen.extract_cache([uid]).values():
            if tokens:
                head = self._head(uid, len(tokens))
                self.kvcache.keep(m.cache, m.keyed(list(tokens)), materialized(cache),
                                  head and materialized(head))
        self._bound_prefix()

    def _head(self, uid: int, tokens: int) -> Optional[list]:
        """The MTP head's state beside the sequence's state of its first `tokens` tokens
        (lazy), where it has one (worker/speculative/mtp_state.py)."""
        spec = self.speculation
        return spec.state_of(uid, tokens) if isinstance(spec, mtp.MTPSpeculation) else None

    def _store(self, uid: int, m: Member, tokens, cache) -> None:
        """A sequence ended: the KV cache keeps its final state (and its name; the MTP
        head's beside it, taken now: its row leaves with the sequence), at `settle`."""
        if self.kvcache is not None and tokens and cache:
            self._ended.append((self.kvcache, m.cache, m.keyed(list(tokens)), cache,
                                self._head(uid, len(tokens))))

    def hold_stores(self) -> None:
        """The caller calls `settle` after each step, once it has sent the step's events
        (the scheduler): materializing an ended sequence's state (a copy of its rows, a
        device sync) and storing it took 0.4-0.75 of a decode step (tiny model, CPU), and
        the request's last tokens and its Done waited for it (issue 36). Until then, the
        next step or a new prompt's lookup settles first."""
        self._held = True

    def settle(self) -> None:
        """The states of the sequences that ended, into the KV cache."""
        if not self._ended:
            return
        ended, self._ended = self._ended, []
        for kvcache, spec, tokens, cache, head in ended:
            kvcache.finish(spec, tokens, materialized(cache), head and materialized(head))
        self._bound_prefix()

    def remove(self, seq) -> None:
        """Drop a sequence (cancelled, failed): at once, whatever stage it is in. One
        cancelled part way through its prompt leaves the KV cache the state its prefill
        reached (`_keep_prefilled`)."""
        uid = getattr(seq, "uid", None)
        if uid in self.members:
            self._keep_prefilled(uid)
            self._leave(uid, in_gen=True, store=False)

    def _keep_prefilled(self, uid: int) -> None:
        """The state of a sequence still being prefilled, kept for later prompts: its
        prompt's chunks so far. Codex opens a session with a warm-up of its ~11K-token
        instructions and, where that takes seconds, starts the turn without it: the
        warm-up is cancelled, and on a cache that cannot be trimmed the turn found only
        the last periodic state the warm-up had kept (8,192 tokens)."""
        found = self.gen._find_uids([uid]).get(uid)
        if self.kvcache is not None and found is not None and found[0] == 1:
            self._keep_state(uid, self.members[uid])  # (stage 1: mlx-lm's prompt batch)

    def _leave(self, uid: int, in_gen: bool, store: bool) -> None:
        m = self.members.pop(uid)
        if in_gen:
            caches = self.gen.remove([uid], return_prompt_caches=store)
            if store:
                for cache, tokens in caches.values():
                    self._store(uid, m, tokens, cache)
        if self.speculation is not None:  # (after `_store`: the MTP head's row with it)
            self.speculation.drop(uid)
        self._reserve()

    def reset(self) -> list:
        """After a failed step: a fresh generator; returns the sequences that were in it."""
        seqs = [m.seq for m in self.members.values()]
        self.members.clear()
        self._ended.clear()  # (states of a generator that failed: not kept)
        self.reserved = 0
        self.gen.close()
        self.gen = self._new_generator()
        return seqs

    def warm(self, prompt_tokens: int = 48) -> None:
        """Short requests through the batch before the worker says it is ready, so the
        first requests pay no kernel compile (worker/loop/warmup.py)."""
        warmup.warm(self, prompt_tokens)

    def run_uncached(self, gens: list) -> None:
        """Run `gens` through the batch together to their end, nothing of them cached."""
        warmup.run_uncached(self, gens)

    def idle(self) -> None:
        """Called between requests (a worker group's leader keeps in touch with its
        ranks here: worker/group/leader.py)."""

    def cache_stats(self) -> Optional[CacheStats]:
        return self.kvcache.stats() if self.kvcache is not None else None

    def kv_stats(self) -> KVStats:
        """The KV memory the running sequences and the prompt cache hold now (their
        allocated rows), in bytes and in tokens of this format."""
        held = self.gen.prompt_cache_nbytes + (  # (and the MTP head's, counted per token)
            self.speculation.nbytes() if self.speculation is not None else 0)
        if self.kvcache is not None:
            held += self.kvcache.prefix.nbytes
        per = self.kv.per_token
        return KVStats(bits=self.kv_format.bits or 0, bytes_per_token=per, bytes=held,
                       tokens=int(held // per) if per else 0)

    def speculation_stats(self) -> Optional[SpeculationStats]:
        if self.speculation is None:
            return None
        return SpeculationStats(**self.speculation.totals.as_dict())

    def close(self) -> None:
        self.settle()
        self.gen.close()
        if self.kvcache is not None:
            self.kvcache.close()  # the writes queued reach the disk
