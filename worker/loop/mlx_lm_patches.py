"""What mlxd changes in mlx-lm's batch machinery (BatchGenerator and its caches), each
change measured where it matters: the CPU launches every kernel of a step, so on a GPU a
small model's step is mostly launch time, and work mlx-lm does per step or per prompt that
a batch of one does not need shows in single-stream decode and time to first token.

`apply()` installs them, once (worker/loop/batch.py calls it on import). Each is a narrow
wrapper that falls back to mlx-lm's own code outside the case it handles, so an mlx-lm
that changes underneath keeps working, only without the gain; the tests in
tests/worker/test_mlx_lm_patches.py compare against mlx-lm's own output.
"""

from __future__ import annotations

import copy
import functools

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, _right_pad_prompts
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache,
                                  RotatingKVCache, create_attention_mask)

from worker.loop import lean

# The per-sequence lists both of mlx-lm's batches keep beside their caches.
_LISTS = ("uids", "tokens", "samplers", "logits_processors", "stop_sequences", "max_tokens")
# ...and those only the generation batch keeps.
_GENERATION_LISTS = ("_next_logprobs", "_token_context", "_num_tokens", "_matchers")


def apply() -> None:
    lean.apply()  # first: the lone-sequence wrapper below calls its step
    _one_sequence_masks_as_a_plain_cache()
    _a_whole_prompt_batch_moves_without_a_copy()
    _one_padding_read_per_batch()
    _prompts_prefill_in_buckets()
    _a_lone_sequence_decodes_on_plain_caches()  # last: its write-back wraps the others


def _one_sequence_masks_as_a_plain_cache() -> None:
    """mlx-lm's BatchKVCache builds an explicit mask array for every step (for the left
    padding of sequences of different lengths), also for a batch of one, where it masks
    nothing a plain KVCache's masks would not: there a decode step needs no mask and a
    prefill chunk the "causal" one, and the attention kernels without an array mask are
    the fast ones. Measured on an H100 (bf16 Qwen2.5 shapes, mlx-lm's BatchGenerator
    alone, one stream): decode at 97 tok/s (0.5B) and 95 (7B) with the array, 127 and 117
    without. A batch of one has no left padding (it was inserted alone, or it is what
    `filter` left, which shifts the smallest padding away), so it gets the plain cache's
    masks; a batch of several keeps the array it always got."""
    original = BatchKVCache.make_mask
    if getattr(original, "mlxd_single", False):
        return

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        if self.left_padding.shape[0] == 1 and not kwargs:
            return create_attention_mask(N, self._idx, return_array, window_size)
        return original(self, N, return_array=return_array, window_size=window_size,
                        **kwargs)

    make_mask.mlxd_single = True
    BatchKVCache.make_mask = make_mask


def _a_lone_sequence_decodes_on_plain_caches() -> None:
    """A sequence decoding alone runs its steps on plain caches, as mlx-lm's own
    single-sequence path (`stream_generate`) does: a BatchKVCache keeps each row's
    position as a device array and adds to it in every layer of every step (a kernel per
    layer: on a GPU, where a small model's step is the CPU launching kernels, a few % of
    the step). A plain cache counts on the host. A sliding window's BatchRotatingKVCache
    costs more: it builds an array mask every step (its rows' padding), which sends the
    layer's attention off the fused decode kernel; a plain RotatingKVCache decodes
    without one. Measured on an H200 (Gemma 4's 2b layout, 28 windowed layers of 35, one
    row, `bench.vision_step`): 12.1 ms a step on plain caches, 17.4 on the worker's batch.

    The views are made at the first step the batch is alone and kept while it stays
    alone: a BatchKVCache's a KVCache sharing its key and value arrays (a batch of one
    has no left padding: `filter` shifts it away), a BatchRotatingKVCache's the row's
    window as mlx-lm's `extract` gives it (a copy, in time order; once a lone spell: its
    padding is not shifted away, and a plain cache has no mask to hide it). A recurrent
    layer's ArraysCache (Qwen3.5's linear attention) is mlx-lm's plain one already and
    stays as it is. Only batches whose every layer is one of those three, and a windowed
    one only without speculation (whose verification trims the caches). Everything else
    that reads the batch's caches (a join's `extend`, `filter`, `extract_cache`) first
    writes them back to the batch caches (`_batched`), so mlx-lm's own code only ever
    sees those."""
    step = GenerationBatch._step
    if getattr(step, "mlxd_lone", False):
        return

    def _step(self):
        if self.__dict__.get("_lone") is None and len(self.uids) == 1:
            views = _views(self.prompt_cache, "mlxd_speculation" not in self.__dict__)
            if views is not None:
                self._lone = (self.prompt_cache, views)
                self.prompt_cache = views
        return step(self)

    _step.mlxd_lone = True
    GenerationBatch._step = _step
    for name in ("extend", "extract_cache", "filter"):
        _batched_first(name)


def _views(caches, windows: bool) -> list | None:
    """A lone row's plain caches, or None where a layer has no plain view (the doc
    above): `windows` says whether a sliding window's may be made."""
    kinds = {type(c) for c in caches}
    if not caches or not kinds <= {BatchKVCache, BatchRotatingKVCache, ArraysCache} \
            or (BatchRotatingKVCache in kinds and not windows) \
            or any(type(c) is BatchKVCache and c._right_padding is not None for c in caches) \
            or any(type(c) is BatchRotatingKVCache and c._lengths is not None for c in caches) \
            or any(type(c) is ArraysCache and c.lengths is not None for c in caches):
        return None
    return [_view(c) if type(c) is BatchKVCache else c if type(c) is ArraysCache
            else _window_view(c) for c in caches]


def _view(c: BatchKVCache) -> KVCache:
    v = KVCache()
    v.keys, v.values, v.offset = c.keys, c.values, c._idx
    return v


def _window_view(c: BatchRotatingKVCache) -> RotatingKVCache:
    if c.keys is None:  # (nothing prefilled: a one-token prompt)
        return RotatingKVCache(c.max_size)
    return c.extract(0)


def lone_tokens(gb):
    """The tokens a lone batch's row holds, read from its plain views (on the host), or
    None when the batch does not decode on views."""
    lone = gb.__dict__.get("_lone")
    if lone is None:
        return None
    return max((v.offset for v in lone[1] if type(v) is KVCache), default=None)


def as_batch(gb) -> None:
    """`gb`'s caches as mlx-lm's batch caches again, where it decodes on views (for code
    that converts them: --quantized-kv-start, worker/loop/batch.py)."""
    _batched(gb)


def _batched(gb) -> None:
    """A lone batch's plain caches written back to its batch caches (no-op otherwise)."""
    lone = gb.__dict__.pop("_lone", None)
    if lone is None:
        return
    caches, views = lone
    for c, v in zip(caches, views):
        if v is c:  # (a recurrent layer's: its own)
            continue
        if type(c) is BatchRotatingKVCache:  # (mlx-lm's own merge of one row)
            c.state = BatchRotatingKVCache.merge([v]).state
            continue
        c.keys, c.values, c._idx = v.keys, v.values, v.offset
        c.offset = mx.array([v.offset])
    gb.prompt_cache = caches


def _batched_first(name: str) -> None:
    original = getattr(GenerationBatch, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        _batched(self)
        for other in args:  # extend's argument: a batch that may be lone too
            if isinstance(other, GenerationBatch):
                _batched(other)
        return original(self, *args, **kwargs)

    setattr(GenerationBatch, name, method)


def _a_whole_prompt_batch_moves_without_a_copy() -> None:
    """When prompts end, mlx-lm splits them off its prompt batch into a generation batch:
    `split` deep-copies the prompt batch's whole KV cache, then filters both copies (a
    gather of every layer's keys and values, and a read of its padding). When every
    prompt in the batch ends at once (always, for a request that arrives alone), the
    original is emptied right after: the copy and the gather are two passes over the
    whole prompt's KV, and dozens of kernel launches per layer, between the prefill and
    the first token, for nothing. Then the batch itself moves: the new batch takes its
    caches and lists, the old one is left empty, as mlx-lm's own split leaves it."""
    original = PromptProcessingBatch.split
    if getattr(original, "mlxd_move", False):
        return

    def split(self, indices):
        indices = sorted(indices)
        if indices != list(range(len(self.uids))):
            return _split_by_gathers(self, indices) or original(self, indices)
        moved = self.__class__.__new__(self.__class__)
        moved.__dict__.update(self.__dict__)
        for name in ("prompt_cache",) + _LISTS:
            setattr(self, name, [])
        return moved

    split.mlxd_move = True
    PromptProcessingBatch.split = split


def _split_by_gathers(batch, indices):
    """The prompts at `indices` as a batch of their own, the rest left in `batch`, both by
    gathering rows (`_filter`), not by mlx-lm's deep copy of the whole batch first (one
    more pass over every layer's keys and values). Staggered arrivals take this path: a
    prompt that has just joined sits beside the one whose prefill ends. None: a cache
    this does not know (mlx-lm's own split then)."""
    if not _plain(batch.prompt_cache):
        return None
    new = batch.__class__.__new__(batch.__class__)
    new.__dict__.update(batch.__dict__)
    for name in _LISTS:
        setattr(new, name, list(getattr(batch, name)))
    # Shallow copies: `_filter` gives each its own arrays before anything is written.
    new.prompt_cache = [copy.copy(c) for c in batch.prompt_cache]
    rest = sorted(set(range(len(batch.uids))) - set(indices))
    batch.filter(rest)
    new.filter(indices)
    return new


# Prompt chunk lengths a prefill rounds up to (tokens; 0: none). Only
# where MLX builds per shape: its CUDA backend.
BUCKET = 128 if mx.cuda.is_available() else 0


def bucket_pad(n: int, step: int | None = None) -> int:
    """The tokens a prefill chunk of `n` is padded by (`BUCKET`), never past `step`
    (mlx-lm's prefill_step_size: the chunk stays one forward pass)."""
    if not BUCKET or n <= 0 or (step is not None and n >= step):
        return 0
    return min(-(-n // BUCKET) * BUCKET, step or n + BUCKET) - n


def bucket_rows(n: int, width: int, positions: int | None) -> int:
    """The rows a pass of `n` prompts runs as: on CUDA (`BUCKET`) the next power of two,
    where rows × `width` stays within `positions` (None: no bound); else `n`. The rows
    are a dimension of the pass's shape too, and a burst reaches a prefill step in as
    many rows as were waiting (3+3+2, 3+5, 4+4 for three waves of 8 on an H200): each new
    count was a new build, 420-580 ms where a count met before took 160-190 (image
    groups, session 19). Rounded up, 1, 2, 4 and 8 rows are the shapes there are; the
    rows added repeat the last one and are never read (worker/vision/group.py, and the
    text prompts' pass below)."""
    rows = 1 << (n - 1).bit_length()
    if not BUCKET or (positions is not None and rows * width > positions):
        return n
    return rows


def _prompts_prefill_in_buckets() -> None:
    """MLX's CUDA backend builds kernels, CUDA graphs and cuDNN attention graphs for each
    new shape of a forward pass: a prompt chunk of a length not seen before costs 50-110
    ms more than the same chunk the second time (an H200, session 13). Served prompts
    are each a new length, so every cold chat paid it in its last chunk: on a lent H200,
    a 1,988-token chat message's prefill took 83.6 ms on the 0.5B shape where a
    2,000-token prompt seen before took 27.1 (bench.ttft_probe --trace); mlx-lm's own
    server and `stream_generate` pay it too. So on CUDA a prompt chunk is padded at its
    end to a multiple of `BUCKET` (a few per cent more positions): shapes repeat, and
    each is built once. A lone prompt runs with its causal mask (the padding comes after
    every real token: none of them attends to it) and the caches are trimmed back by the
    padding, so that the row stays a batch of one without left padding (the plain masks
    and lone decode above rely on that); several prompts take mlx-lm's own right padding
    (`prepare`, then `finalize` moves each row's padding to its left), to the bucket
    rather than to the longest, and as a power of two rows (`bucket_rows`) where every
    row starts from nothing on plain caches and the added rows keep the pass within its
    rows' chunks (`prefill_step_size` each: what the step's memory was fitted for); the
    added rows are filtered out after the pass. Only on caches that take the padding back
    (`_paddable`: plain attention caches, and a sliding window's while the pass fits in
    it) of an mlx-lm model's forward (`_plain_model`), a chunk under `step`; anything else
    is mlx-lm's own `prompt`."""
    original = PromptProcessingBatch.prompt
    if getattr(original, "mlxd_buckets", False):
        return

    def prompt(self, tokens):
        longest = max((len(t) for t in tokens), default=0)
        pad = bucket_pad(longest, self.prefill_step_size)
        if not pad or len(self.uids) != len(tokens) or not _plain_model(self.model) \
                or not _paddable(self.prompt_cache, longest + pad):
            return original(self, tokens)
        for held, new in zip(self.tokens, tokens):
            held += new
        width = longest + pad
        if len(tokens) == 1:
            self.model(mx.array([list(tokens[0]) + [tokens[0][-1]] * pad]),
                       cache=self.prompt_cache)
            for c in self.prompt_cache:
                c.trim(pad)
        else:  # (mlx-lm's own `prompt` with its padding to `width`)
            n, caches = len(tokens), self.prompt_cache
            extra = 0
            if all(type(c) is BatchKVCache and c.keys is None for c in caches):
                extra = bucket_rows(n, width, n * self.prefill_step_size) - n
            rows = list(tokens) + [tokens[-1]] * extra  # (the added rows: never read)
            for c in caches:
                if extra:
                    c.extend(BatchKVCache([0] * extra))
                c.prepare(lengths=[len(t) for t in rows],
                          right_padding=[width - len(t) for t in rows])
            self.model(_right_pad_prompts(rows, max_length=width), cache=caches)
            mx.eval([c.state for c in caches])
            for c in caches:
                c.finalize()
            if extra:
                _filter(caches, list(range(n)))
        mx.eval([c.state for c in self.prompt_cache])
        mx.clear_cache()

    prompt.mlxd_buckets = True
    PromptProcessingBatch.prompt = prompt


def _plain_model(model) -> bool:
    """An mlx-lm model's forward: a text model, or a vision checkpoint's language model
    (worker/vision/language.py: its rows' position deltas move every position of a row
    alike, the padding's after its real tokens), not the MTP head's reader
    (worker/speculative/mtp_prefill.py), which would see the padding."""
    return type(model).__module__.startswith("mlx_lm.")


def _paddable(caches, width: int) -> bool:
    """Whether a pass of `width` positions may carry padding at its end: every layer's
    cache a plain attention one, or a sliding window's (Gemma 3 and 4, gpt-oss) that holds
    the whole pass without rotating: nothing the window keeps is pushed out by padding
    (mlx-lm's right padding of several prompts rolls it away at `finalize`), and a lone
    prompt's padding is trimmed back as a plain cache's is (BatchRotatingKVCache.trim,
    while it has not wrapped). A window the pass would wrap, or a recurrent state, keeps
    mlx-lm's own `prompt`."""
    return bool(caches) and all(
        type(c) is BatchKVCache
        or (type(c) is BatchRotatingKVCache and c._offset + width <= c.max_size)
        for c in caches)


def _one_padding_read_per_batch() -> None:
    """mlx-lm's BatchKVCache reads the batch's left padding back from the device once per
    LAYER in `extract` (a finished sequence's cache, for the prompt cache) and in `filter`
    (a sequence leaves the batch): a small kernel and a wait for the device each, 48 per
    finished sequence on a 24-layer model. Measured on an H200 (0.5B shape, 8 streams
    joining and leaving one step apart): 11 ms per sequence that leaves, against 6.5 ms
    for a whole decode step. Every layer of a batch holds the same padding (the layers
    are merged, padded, extended and filtered together), so both batches read it once,
    from the first layer, and slice every layer by it. A batch with any other kind of
    cache (rotating, recurrent, quantized) keeps mlx-lm's per-layer methods."""
    for cls in (GenerationBatch, PromptProcessingBatch):
        _wrap_extract(cls)
        _wrap_filter(cls)


def _plain(caches) -> bool:
    return bool(caches) and all(type(c) is BatchKVCache and c._right_padding is None
                                for c in caches)


def _wrap_extract(cls) -> None:
    original = cls.extract_cache
    if getattr(original, "mlxd_one_read", False):
        return

    def extract_cache(self, idx: int):
        caches = self.prompt_cache
        if not _plain(caches):
            return original(self, idx)
        padding = caches[0].left_padding[idx].item()  # the one read
        out = []
        for c in caches:  # BatchKVCache.extract, the padding given
            kv = KVCache()
            kv.keys = mx.contiguous(c.keys[idx: idx + 1, :, padding: c._idx])
            kv.values = mx.contiguous(c.values[idx: idx + 1, :, padding: c._idx])
            kv.offset = kv.keys.shape[2]
            out.append(kv)
        return out

    extract_cache.mlxd_one_read = True
    cls.extract_cache = extract_cache


def _wrap_filter(cls) -> None:
    original = cls.filter
    if getattr(original, "mlxd_one_read", False):
        return

    def filter(self, keep):
        caches = self.prompt_cache
        if not keep or not _plain(caches):
            return original(self, keep)
        rows = _filter(caches, keep)
        names = _LISTS
        if isinstance(self, GenerationBatch):  # what only the generation batch keeps
            self._next_tokens = self._next_tokens[rows]
            names += _GENERATION_LISTS
        for name in names:
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])

    filter.mlxd_one_read = True
    cls.filter = filter


def _filter(caches, keep) -> mx.array:
    """BatchKVCache.filter on every layer, the smallest padding left read once; returns
    the rows kept, as the index array the layers were gathered by."""
    rows = mx.array(keep)
    shift = min(caches[0].left_padding[rows].tolist())  # the one read
    for c in caches:
        if c.keys is not None:
            c.keys, c.values = c.keys[rows], c.values[rows]
        c.offset, c.left_padding = c.offset[rows], c.left_padding[rows]
        if shift > 0:  # shift left: the padding every row has goes
            if c.keys is not None:
                c.keys, c.values = c.keys[..., shift:, :], c.values[..., shift:, :]
            c._idx -= shift
            c.left_padding = c.left_padding - shift
    return rows
