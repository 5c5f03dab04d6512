"""A vision-language model's continuous batch: the text batch (worker/loop/batch.py, on
mlx-lm's BatchGenerator over the checkpoint's language model as mlx-lm's text class,
worker/vision/language.py), with what an image adds to a sequence.

- Its images' prefill. mlx-lm's batch takes token ids; an image's tokens stand for the
  vision tower's features. So a prompt with images is prefilled, from where the KV cache
  left it, up to its last image token by mlx-vlm's own step (`get_input_embeddings`: the
  vision tower, its features merged into the prompt's embeddings, the 3-D rotary
  positions of Qwen's families; then mlx-vlm's language model on its own caches, whose
  state is then handed to mlx-lm's, `_carry`), one chunk each `step` before the text
  batch's step (the vision tower with the first), so the running streams wait a chunk a
  step for it as for a text prompt, and a cancel lands between chunks; then it joins
  the batch from that state, like a cached prefix, for the rest of its prompt and its
  decoding. mlx-vlm's BatchGenerator does the same in one batch, but with one sampler
  for all, no per-sequence logits processors and no starting state of ours (prefix
  cache, snapshots): its model step is what is used. A model whose step refuses a
  chunked prefill of these inputs (mlx-vlm's `chunked_prefill_policy`: the large Gemma 4
  checkpoints, whose image tokens attend each other both ways, told by the processor's
  token types) gets it in chunks cut anywhere but inside an image's span
  (worker/vision/spans.py), where mlx-vlm's own generation takes it whole.
- Its positions: after an image, a token's rotary position is its index plus the
  sequence's delta (mlx-vlm's `rope_deltas`), which the batch's forward passes add per
  row (language.py `Positions`; `_tell_rows` says which rows each pass runs). A state
  taken from the KV cache gets its delta from the whole prompt's positions
  (`get_rope_index`, from the token ids and image grids alone): the vision tower does
  not run for an image the cache already holds. Each image moves the positions after it
  by what its grid alone sets (its tokens span max(t, h, w) positions, not t·h·w), so a
  prompt's delta is a function of its images' grids: kept by them (`_deltas`), the next
  turn about an image reads it, where `get_rope_index` walks the whole prompt in Python
  (4-9 ms on a 2,000-token prompt on the CPU, a device sync per image on a GPU).
- Its cache key (worker/vision/engine.py `media_key`): image tokens as their image's
  bytes, so a different image never reuses a state and the same one always can.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_vlm.generate.common import _chunked_prefill_enabled as chunked_prefill_enabled
from mlx_lm.models.cache import QuantizedKVCache
from mlx_vlm.models.cache import make_prompt_cache as make_vlm_cache

from worker.kvcache.attention import dequantize
from worker.kvcache.manager import Start, Tier
from worker.kvcache.quantized import to_quantized
from worker.loop.batch import Batch, materialized
from worker.vision import spans, towers
from worker.vision.engine import KEY, encoded, media_tokens, model_inputs, warm_requests
from worker.vision.group import Together, groupable

log = logging.getLogger("worker.vision")

# The processor's arrays that set a prompt's position delta (Qwen's families), and how
# many prompts' deltas are kept by them.
_GRIDS = ("image_grid_thw", "video_grid_thw")
# The processor's arrays, one a token, that say which tokens are an image's (or audio's):
# the large Gemma 4's step attends both ways within an image with them, in a chunk that
# holds the image whole (an image and a clip in one prompt: causal, as mlx-vlm runs it).
_TYPES = ("mm_token_type_ids", "token_type_ids")
_DELTAS_KEPT = 1024
spans.install()


def _tell_rows() -> None:
    """Before each of mlx-lm's batched forward passes (a prompt chunk, a decode step),
    the model's `Positions` (when it has one) learns which sequences' rows it runs."""
    for cls, name in ((GenerationBatch, "_step"), (PromptProcessingBatch, "prompt")):
        original = getattr(cls, name)
        if getattr(original, "mlxd_rows", False):
            continue

        def method(self, *args, _original=original, **kwargs):
            positions = getattr(self.model, "mlxd_positions", None)
            if positions is None:
                return _original(self, *args, **kwargs)
            positions.rows(self.uids)
            try:
                return _original(self, *args, **kwargs)
            finally:  # (the pass has its offsets; a forward outside a batch has none)
                positions.done()

        functools.update_wrapper(method, original)
        method.mlxd_rows = True
        setattr(cls, name, method)


_tell_rows()


def _carry(source: list, target: list) -> list:
    """`target` (fresh caches, layer by layer) holding `source`'s state: mlx-vlm's step
    runs on mlx-vlm's cache classes (its linear-attention layers write their window
    through them), the batch on mlx-lm's; both keep a layer's state as the same arrays
    (attention keys and values up to the offset, a recurrent layer's conv and state),
    and a sliding window's rotating cache keeps the same fields in both (its buffer as
    it stands, where it wraps, what it keeps). Only these kinds of cache
    (worker/vision/language.py `CARRIED`)."""
    for s, t in zip(source, target, strict=True):
        if isinstance(s, QuantizedKVCache) or isinstance(t, QuantizedKVCache):
            _carry_quantized(s, t)  # (--kv-bits: worker/kvcache/quantized.py)
        elif isinstance(getattr(t, "cache", None), list):  # recurrent: its arrays
            t.cache = list(s.cache)
        elif hasattr(t, "_idx"):  # rotating: the buffer whole (new array objects: each
            # cache writes its own in place), with its write position and bounds
            t.keys, t.values = (None, None) if s.keys is None else (s.keys[...], s.values[...])
            t.offset, t._idx, t.keep, t.max_size = s.offset, s._idx, s.keep, s.max_size
        else:
            keys, values = s.keys[..., :s.offset, :], s.values[..., :s.offset, :]
            t.keys, t.values, t.offset = keys, values, s.offset
    return target


def _carry_quantized(s, t) -> None:
    """An attention layer's state between a quantized cache (--kv-bits: the batch's, the
    KV cache's) and a full-precision one (mlx-vlm's, which the image prefill runs on):
    quantized on the way to the batch, dequantized on the way to an image's prefill (the
    prompt before it then reads what a quantized cache holds, as a text chunk after it
    does)."""
    if s.keys is None:
        return
    if isinstance(t, QuantizedKVCache):
        q = to_quantized(s, t.group_size, t.bits)
        t.keys, t.values = q.keys, q.values
    else:
        t.keys, t.values = (dequantize(tuple(a[..., :s.offset, :] for a in x), s.group_size,
                                       s.bits) for x in (s.keys, s.values))
    t.offset = s.offset


def _grids(media: dict) -> tuple:
    """A prompt's image and video grids (the processor's, rows of (t, h, w)), as a key."""
    return tuple(None if media.get(k) is None else tuple(np.asarray(media[k]).reshape(-1).tolist())
                 for k in _GRIDS)


@dataclass
class _Prefill:
    """An image prompt being prefilled through its last image token (by mlx-vlm's step),
    before it joins mlx-lm's batch."""
    seq: Any
    prep: Any
    hit: Any             # the KV cache's start (None: from scratch)
    inputs: mx.array     # the prompt's ids, (1, n)
    pixels: mx.array
    mask: Any            # the processor's attention mask (None: none)
    kwargs: dict         # the processor's other arrays the model's step takes
    end: int             # one past its last image token
    pos: int = 0         # prompt tokens in `cache`
    cache: Any = None    # mlx-vlm's caches, once the images are embedded
    embeds: Any = None
    extra: dict = field(default_factory=dict)
    whole: list = field(default_factory=list)  # the image spans no chunk may cut, where
    # the model's step attends within them both ways (none: chunked anywhere, causal)
    keep: list = field(default_factory=list)  # prompt lengths whose state the KV cache
    # keeps on the way (`_keep_points`)


class VisionBatch(Batch):
    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self.vlm = engine.vlm
        self.positions = engine.model.mlxd_positions
        self.media_tokens = media_tokens(self.vlm.config)
        self.prefilling: list[_Prefill] = []   # admitted, their images being prefilled
        self._deltas: OrderedDict[tuple, int] = OrderedDict()  # grids → delta, LRU first

    def __len__(self) -> int:
        return len(self.members) + len(self.prefilling)

    def running_tokens(self) -> list[int]:
        return super().running_tokens() + [self.tokens(p.prep) for p in self.prefilling]

    # ---- a sequence's start ----------------------------------------------------------

    def cache_key(self, prep) -> list:
        key = (prep.media or {}).get(KEY)
        return key if key is not None else prep.ids

    def add(self, seq, prep) -> int:
        """Start `prep`: into mlx-lm's batch now when the KV cache holds all its images
        (or it has none), else once `step` has prefilled them, a chunk a step."""
        media = prep.media or {}
        if not encoded(media):
            return super().add(seq, prep)
        # (an image prompt takes even a short start: it spares the pass before its image,
        # or is dropped where a group computes it anyway: `_together`)
        hit = self.cached_start(prep, 0)
        cached = hit.tokens if hit is not None else 0
        ids = prep.ids
        end = 1 + max(i for i, t in enumerate(ids) if t in self.media_tokens)
        if cached >= end:  # the KV cache holds every image: no vision tower, no pixels
            self._join(seq, prep, hit, self._rope_delta(ids, media))
            return cached
        job = _Prefill(seq, prep, hit, mx.array(ids)[None], *model_inputs(media), end, cached)
        job.keep = self._keep_points(ids, cached, end)
        seq.uid = None
        self.prefilling.append(job)
        self._reserve()
        self._bound_prefix()
        return cached

    def _keep_points(self, ids: list[int], cached: int, end: int) -> list[int]:
        """Where an image prompt's prefill hands its state to the KV cache on the way,
        for a cache that cannot be trimmed (a sliding window, recurrent layers): the
        prompt before its first image, so that the same text (an agent's system prompt,
        the turns before) with another image resumes there, as a trimmable cache's final
        state would be trimmed to it; and the KV cache's own checkpoints of the whole
        prompt (worker/kvcache/manager.py `checkpoints`) that fall before the last
        image's end (the batch keeps those after it). Asked of the images' part alone,
        the checkpoints would end with its "prompt but its last token", a state inside
        the last image that no later prompt can use: an extra pass each image prompt
        (and a copy of its KV) for nothing."""
        if self.kvcache is None or self.kvcache.trimmable:
            return []
        first = min(i for i, t in enumerate(ids) if t in self.media_tokens)
        points = {first} | {p for p in self.kvcache.checkpoints(cached, len(ids)) if p < end}
        return sorted(p for p in points if p > cached)

    def step(self) -> list:
        """Image prompts' prefill, a chunk's worth of tokens in all (the vision tower with
        each prompt's first chunk), then the text batch's step. The chunk is shared in
        arrival order: the first prompt takes a chunk of it, as one prompt always did,
        and those behind it that fit whole in what is left (a chat with an image) are
        prefilled in the same step, so a burst of them joins the text batch together,
        its text tails prefilled as one batch, rather than one prompt every few steps
        (the last of 8 image chats waited ~24 steps, each with the running rows' decode:
        a tiny Gemma 4, bench.worker_timeline --images). A prompt's chunk that ends at a
        point where the KV cache keeps its state goes on past it in the same step while
        the next chunk fits what is left; an image kept whole that does not fit waits for
        the next step, a chunk of its own. Those at the front that start from nothing
        and fit whole go first, as one batch where two or more can (`_together`)."""
        budget = max(1, self.chunks.size)
        together = self._together(budget)
        budget -= together
        for n, job in enumerate(list(self.prefilling)):
            if (n or together) and job.end - job.pos > budget:  # (the next ones wait for
                break                   # a chunk of their own: none is cut short here)
            first = True  # (a chunk ends at each point the KV cache keeps: the next goes
            while budget > 0 and job in self.prefilling:  # on where it fits what is left)
                if not first and self._cut(job, budget) - job.pos > budget:
                    break
                budget -= self._prefill_chunk(job, budget)
                first = False
            if budget <= 0:
                break
        return super().step()

    def _together(self, budget: int) -> int:
        """The image prompts at the front of the queue that fit whole in a chunk of
        `budget` and together in `prefill_batch` chunks' positions (left-padded to the
        longest: the bound on a step's prefill that text prompts have, sizing.py
        `prompts_for_step`), prefilled as one batch where two or more can be
        (worker/vision/group.py); the tokens it prefilled.

        A prompt with a cached start (a chat template's header, the same words before
        another image) goes in the batch from nothing, its start dropped, where the
        whole of it fits that bound: the batch computes those tokens again in the pass
        it runs anyway, where keeping them would take a pass or two of its own (the rows
        of a left-padded batch start at one length). Served on an H200, every image chat
        of a burst had such a start (11-13 tokens, 2b Gemma 4) and went alone: two
        passes of 15-100 ms each. One whose start is longer than a chunk (an agent's
        system prompt) keeps it and goes alone. Its `cached_tokens` still report the
        start: the cache held them."""
        if self.max_kv_size is not None:  # (its windows: mlx-vlm's per-prompt caches)
            return 0
        run, width = [], 0  # (rows × the longest: what a left-padded pass computes)
        for job in self.prefilling:
            cached = job.hit.tokens if job.hit is not None else 0
            if job.pos != cached or job.end > budget or (
                    (len(run) + 1) * max(width, job.end) > self.prefill_batch * budget):
                break
            run.append(job)
            width = max(width, job.end)
        if len(run) < 2:
            return 0
        fresh = [job for job in run if job.cache is None]  # (the images' tower: once)
        for job, features in zip(fresh, towers.encode(self.vlm, fresh)):
            self._embed(job, features)
        group = [job for job in run if groupable(job)]
        if len(group) < 2:
            return 0
        for job in group:  # (its points to keep stay those after its start: the KV
            # cache holds the start and what came before it)
            if job.hit is not None:
                job.hit, job.pos = None, 0
                job.cache = make_vlm_cache(self.vlm.language_model, self.max_kv_size)
        batch = Together(self.vlm.language_model, group,  # (group.py: rows repeated)
                         2 * self.prefill_batch * budget)
        for column in sorted({batch.column(job, p) for job in group for p in job.keep}
                             | {batch.width}):
            batch.run_to(column)
            for job in group:
                if job.keep and batch.column(job, job.keep[0]) == column:
                    self._keep(job, job.keep.pop(0), batch.state(job))
        for job in group:
            job.pos = job.end
            self._finish(job, batch.state(job))
        return sum(job.end for job in group)

    def _embed(self, job: _Prefill, features=None) -> None:
        """`job`'s embeddings (the vision tower, or its images' `features` from the
        tower run for several: worker/vision/towers.py) and mlx-vlm's caches for its
        prefill, once."""
        if job.cache is not None:
            return
        vlm = self.vlm
        given = {} if features is None else {"cached_image_features": features}
        embedded = vlm.get_input_embeddings(job.inputs, job.pixels, mask=job.mask,
                                            **job.kwargs, **given)
        job.embeds = embedded.inputs_embeds
        job.extra = {k: v for k, v in embedded.to_dict().items()
                     if k != "inputs_embeds" and v is not None}
        job.cache = make_vlm_cache(vlm.language_model, self.max_kv_size)
        if job.hit is not None:
            _carry(job.hit.cache, job.cache)
        if not chunked_prefill_enabled(vlm, input_ids=job.inputs, inputs_embeds=job.embeds,
                                       prefill_kwargs={**job.kwargs, **job.extra}):
            types = next((v for k, v in job.kwargs.items() if k in _TYPES), None)
            job.whole = spans.spans(types) if types is not None else [(0, job.end)]

    def _prefill_chunk(self, job: _Prefill, size: int) -> int:
        """One chunk of `job`'s prefill, of about `size` tokens (an image kept whole may
        make it longer); the tokens it prefilled."""
        self._embed(job)
        a, b = job.pos, self._cut(job, size)
        types = {k: v[:, a:b] for k, v in job.kwargs.items() if k in _TYPES and job.whole}
        self.vlm.language_model(job.inputs[:, a:b], inputs_embeds=job.embeds[:, a:b],
                                cache=job.cache, n_to_process=b - a, **job.extra, **types)
        mx.eval([c.state for c in job.cache])
        job.pos = b
        while job.keep and job.keep[0] < b:  # (inside an image kept whole: passed)
            job.keep.pop(0)
        if job.keep and job.keep[0] == b:
            self._keep(job, job.keep.pop(0), job.cache)
        if b == job.end:
            self._finish(job, job.cache)
        return b - a

    def _keep(self, job: _Prefill, point: int, cache: list) -> None:
        """The KV cache keeps `cache` (mlx-vlm's, `job`'s first `point` tokens)."""
        state = _carry(cache, self.kv_format.make(self.engine.model, self.max_kv_size))
        self.kvcache.keep(job.prep.gen.cache, self.cache_key(job.prep)[:point],
                          materialized(state))
        self._bound_prefix()

    def _finish(self, job: _Prefill, cache: list) -> None:
        """`job` prefilled through its last image (`cache`, mlx-vlm's): into mlx-lm's
        batch from there."""
        self.prefilling.remove(job)
        deltas = job.extra.get("rope_deltas")
        fresh = self.kv_format.make(self.engine.model, self.max_kv_size)
        start = Start(_carry(cache, fresh), job.end,
                      job.hit.tier if job.hit is not None else Tier.PREFIX)
        delta = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
        self._keep_delta(job.prep.media, delta)
        self._join(job.seq, job.prep, start, delta,
                   began=job.hit.tokens if job.hit is not None else 0)

    def _cut(self, job: _Prefill, size: int) -> int:
        """Where `job`'s next chunk of about `size` tokens ends: at its last image token,
        at the next point the KV cache keeps, and never inside an image kept whole."""
        a = job.pos
        return spans.cut(a, min(job.end, a + max(1, size), *job.keep[:1]), job.whole)

    def _join(self, seq, prep, start, delta: int, began: Optional[int] = None) -> None:
        """`seq` into mlx-lm's batch from `start`, its positions moved by `delta` from
        there on (`began`: Batch.insert's)."""
        self.insert(seq, prep, start, began)
        if delta:
            self.positions.deltas[seq.uid] = delta

    def _rope_delta(self, ids: list[int], media: dict) -> int:
        """The prompt's position delta, from its images' grids (the module's doc): kept,
        else from its token ids and grids by the model's `get_rope_index` (none: 0, a
        family whose positions are the tokens' indices)."""
        index = getattr(self.vlm.language_model, "get_rope_index", None)
        if index is None:
            return 0
        delta = self._deltas.get(_grids(media))
        if delta is not None:
            self._deltas.move_to_end(_grids(media))
            return delta
        grid = {k: mx.array(media[k]) if media.get(k) is not None else None for k in _GRIDS}
        _, deltas = index(mx.array(ids)[None], grid["image_grid_thw"], grid["video_grid_thw"],
                          None)
        delta = int(mx.array(deltas).reshape(-1)[0].item()) if deltas is not None else 0
        self._keep_delta(media, delta)
        return delta

    def _keep_delta(self, media: dict, delta: int) -> None:
        self._deltas[_grids(media)] = delta
        while len(self._deltas) > _DELTAS_KEPT:
            self._deltas.popitem(last=False)

    # ---- a sequence's end ------------------------------------------------------------

    def _leave(self, uid: int, in_gen: bool, store: bool) -> None:
        super()._leave(uid, in_gen, store)
        self.positions.deltas.pop(uid, None)

    def remove(self, seq) -> None:
        for job in self.prefilling:
            if job.seq is seq:
                self.prefilling.remove(job)
                self._reserve()
                return
        super().remove(seq)

    def reset(self) -> list:
        self.positions.clear()  # (a fresh generator counts its uids from 0)
        seqs = [job.seq for job in self.prefilling]
        self.prefilling.clear()
        return super().reset() + seqs

    def warm(self, prompt_tokens: int = 48) -> None:
        """The text batch's warm-up, then a short image request (and audio request, for
        a model that hears it): the vision (audio) tower and the media prefill compile
        before Ready too."""
        super().warm(prompt_tokens)
        self.run_uncached(warm_requests(self.engine.hearing is not None)[1:])
