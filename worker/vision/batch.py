"""A vision-language model's continuous batch: the text batch (worker/loop/batch.py, on
mlx-lm's BatchGenerator over the checkpoint's language model as mlx-lm's text class,
worker/vision/language.py), with what an image adds to a sequence.

- Its images' prefill. mlx-lm's batch takes token ids; an image's tokens stand for the
  vision tower's features. So a prompt with images is prefilled, from where the KV cache
  left it, up to its last image token by mlx-vlm's own step (`get_input_embeddings`: the
  vision tower, its features merged into the prompt's embeddings, the 3-D rotary
  positions of Qwen's families; then mlx-vlm's language model, chunk by chunk, on its own
  caches, whose state is then handed to mlx-lm's, `_carry`), and joins the batch from
  that state, like a cached prefix, for the rest of its prompt and its decoding. mlx-vlm's BatchGenerator does the
  same in one batch, but with one sampler for all, no per-sequence logits processors and
  no starting state of ours (prefix cache, snapshots): its model step is what is used.
  That prefill runs when the sequence is admitted, between two steps of the others.
- Its positions: after an image, a token's rotary position is its index plus the
  sequence's delta (mlx-vlm's `rope_deltas`), which the batch's forward passes add per
  row (language.py `Positions`; `_tell_rows` says which rows each pass runs). A state
  taken from the KV cache gets its delta from the whole prompt's positions
  (`get_rope_index`, from the token ids and image grids alone): the vision tower does
  not run for an image the cache already holds.
- Its cache key (worker/vision/engine.py `media_key`): image tokens as their image's
  bytes, so a different image never reuses a state and the same one always can.
"""

from __future__ import annotations

import functools
import logging

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import make_prompt_cache
from mlx_vlm.models.cache import make_prompt_cache as make_vlm_cache

from worker.kvcache.manager import Start, Tier
from worker.loop.batch import Batch
from worker.vision.engine import _NOT_KWARGS, KEY, media_tokens, warm_requests

log = logging.getLogger("worker.vision")


def _tell_rows() -> None:
    """Before each of mlx-lm's batched forward passes (a prompt chunk, a decode step),
    the model's `Positions` (when it has one) learns which sequences' rows it runs."""
    for cls, name in ((GenerationBatch, "_step"), (PromptProcessingBatch, "prompt")):
        original = getattr(cls, name)
        if getattr(original, "mlxd_rows", False):
            continue

        def method(self, *args, _original=original, **kwargs):
            positions = getattr(self.model, "mlxd_positions", None)
            if positions is not None:
                positions.rows(self.uids)
            return _original(self, *args, **kwargs)

        functools.update_wrapper(method, original)
        method.mlxd_rows = True
        setattr(cls, name, method)


_tell_rows()


def _carry(source: list, target: list) -> list:
    """`target` (fresh caches, layer by layer) holding `source`'s state: mlx-vlm's step
    runs on mlx-vlm's cache classes (its linear-attention layers write their window
    through them), the batch on mlx-lm's; both keep a layer's state as the same arrays
    (attention keys and values up to the offset, a recurrent layer's conv and state).
    Only these two kinds of cache (worker/vision/language.py `CARRIED`)."""
    for s, t in zip(source, target, strict=True):
        if isinstance(getattr(t, "cache", None), list):  # recurrent: its arrays
            t.cache = list(s.cache)
            continue
        keys, values = s.keys[..., :s.offset, :], s.values[..., :s.offset, :]
        t.keys, t.values, t.offset = keys, values, s.offset
    return target


class VisionBatch(Batch):
    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self.vlm = engine.vlm
        self.positions = engine.model.mlxd_positions
        self.media_tokens = media_tokens(self.vlm.config)
        self._delta = 0   # the delta of the sequence `add` is starting

    # ---- a sequence's start ----------------------------------------------------------

    def cache_key(self, prep) -> list:
        key = (prep.media or {}).get(KEY)
        return key if key is not None else prep.ids

    def prefill_media(self, prep, hit):
        """Prefill `prep`'s prompt from `hit` through its last image token (none: `hit`
        as it is), and note its position delta."""
        self._delta = 0
        media = prep.media or {}
        if media.get("pixel_values") is None:
            return hit
        ids = prep.ids
        end = 1 + max(i for i, t in enumerate(ids) if t in self.media_tokens)
        start = hit.tokens if hit is not None else 0
        inputs = mx.array(ids)[None]
        kwargs = {k: mx.array(v) for k, v in media.items() if k not in _NOT_KWARGS}
        if start >= end:  # the KV cache holds every image: no vision tower
            self._delta = self._rope_delta(inputs, kwargs)
            return hit
        vlm = self.vlm
        embedded = vlm.get_input_embeddings(inputs, mx.array(media["pixel_values"]),
                                            mask=None, **kwargs)
        extra = {k: v for k, v in embedded.to_dict().items()
                 if k != "inputs_embeds" and v is not None}
        deltas = extra.get("rope_deltas")
        self._delta = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
        embeds = embedded.inputs_embeds
        cache = make_vlm_cache(vlm.language_model)
        if hit is not None:
            _carry(hit.cache, cache)
        chunk = max(1, self.chunks.size)
        for a in range(start, end, chunk):
            b = min(end, a + chunk)
            vlm.language_model(inputs[:, a:b], inputs_embeds=embeds[:, a:b], cache=cache,
                               n_to_process=b - a, **extra)
            mx.eval([c.state for c in cache])
        return Start(_carry(cache, make_prompt_cache(self.engine.model)), end,
                     hit.tier if hit is not None else Tier.PREFIX)

    def _rope_delta(self, inputs, kwargs) -> int:
        """The prompt's position delta from its token ids and image grids alone (0 for a
        family whose positions are the tokens' indices)."""
        index = getattr(self.vlm.language_model, "get_rope_index", None)
        if index is None:
            return 0
        _, deltas = index(inputs, kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"),
                          None)
        return int(mx.array(deltas).reshape(-1)[0].item()) if deltas is not None else 0

    def add(self, seq, prep) -> int:
        cached = super().add(seq, prep)
        if self._delta:
            self.positions.deltas[seq.uid] = self._delta
        return cached

    # ---- a sequence's end ------------------------------------------------------------

    def _leave(self, uid: int, in_gen: bool, store: bool) -> None:
        super()._leave(uid, in_gen, store)
        self.positions.deltas.pop(uid, None)

    def reset(self) -> list:
        self.positions.clear()  # (a fresh generator counts its uids from 0)
        return super().reset()

    def warm(self, prompt_tokens: int = 48) -> None:
        """The text batch's warm-up, then a short image request: the vision tower and
        the image prefill compile before Ready too."""
        super().warm(prompt_tokens)
        self.run_uncached(warm_requests()[1:])
