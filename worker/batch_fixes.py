"""What mlxd changes in mlx-lm's batch machinery (BatchGenerator and its caches), each
change measured where it matters: the CPU launches every kernel of a step, so on a GPU a
small model's step is mostly launch time, and work mlx-lm does per step or per prompt that
a batch of one does not need shows in single-stream decode and time to first token.

`apply()` installs them, once (worker/batch.py calls it on import). Each is a narrow
wrapper that falls back to mlx-lm's own code outside the case it handles, so an mlx-lm
that changes underneath keeps working, only without the gain; the tests in
tests/worker/test_worker_batching.py compare against mlx-lm's own output.
"""

from __future__ import annotations

from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, create_attention_mask


def apply() -> None:
    _one_sequence_masks_as_a_plain_cache()
    _a_whole_prompt_batch_moves_without_a_copy()


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
        if sorted(indices) != list(range(len(self.uids))):
            return original(self, indices)
        moved = self.__class__.__new__(self.__class__)
        moved.__dict__.update(self.__dict__)
        for name in ("uids", "prompt_cache", "tokens", "samplers", "logits_processors",
                     "stop_sequences", "max_tokens"):
            setattr(self, name, [])
        return moved

    split.mlxd_move = True
    PromptProcessingBatch.split = split
