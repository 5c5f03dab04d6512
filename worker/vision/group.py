"""Image prompts of one step prefilled as one batch (worker/vision/batch.py `VisionBatch`).

An image prompt's prefill runs mlx-vlm's language model on the prompt's embeddings, up to
its last image token; done prompt by prompt, a burst of 8 image chats took 16 forward
passes before any joined the text batch (the pass before the image, where the KV cache
keeps the state, then the image), each a new shape for MLX to build on a GPU (15-78 ms a
pass on an H200, session 14). mlx-vlm's own `batch_generate` embeds a group of image
prompts and prefills them as one left-padded batch; here the same, with mlx-vlm's own
parts: each prompt's embeddings and the arrays its step takes (per-layer inputs, 3-D
positions) merged and left-padded by `_merge_prefill_prompt_kwargs`, its batch caches by
`_make_cache`, and each row's state taken out by the caches' `extract` (mlx-vlm's batch
prefill's own), then carried into mlx-lm's caches as a lone prompt's is.

Left padding lines the prompts' ends up, so a point where the KV cache keeps one prompt's
state (worker/vision/batch.py `_keep_points`: before its first image, on a cache that
cannot be trimmed) is a column of the batch: the batch's passes end at every such
column, and each row's state is taken there. A burst of chats with one image of one size
each after their text keeps its states at one column, in two passes in all.

On CUDA the batch's width is rounded up to a multiple of mlx_lm_patches.BUCKET (more
left padding for every row): MLX's CUDA backend builds each new shape of a forward pass
(50-110 ms), and a burst's widths differ with its words, so the group's passes (a
column before the images, then the images) were each a new shape: 267-400 ms for 3-5
rows of 280 tokens on a lent H200 (2b Gemma 4, bench.worker_timeline --images) where a
prompt alone took two passes of 15-70 ms. With the width bucketed, and the images of a
size, both passes repeat their shapes from one burst of as many rows to the next. But
a burst reaches the batch in groups of as many rows as were prepared and fit the step's
bound (`prefill_batch` chunks' positions, the chunk sized by time: 3+3+2, 3+5, 4+4 in
three waves of 8 on an H200), and each new row count was a new shape again: a group of
819 tokens in 3 rows took 160 ms where 5 rows (1,375) took 579 and 2 rows (550) 538,
the first time each. So on CUDA the rows are rounded up too, to a power of two
(mlx_lm_patches `bucket_rows`, as text prompts' passes are; the last row repeated, its
results never read): 1, 2, 4 and 8 rows are the shapes there are. The repeated rows at
most double the pass's positions, which the batch allows (`positions`: twice the step's
bound); a GPU computes them in far less time than it builds a new shape.

Which prompts go together (`groupable`, and batch.py `_together`): those that start from
nothing, or from a cached start short enough to compute again in the batch (a chat
template's header: a cached prefix is a different length of state per row, which a
left-padded batch cannot start from; served on a GPU, nearly every image chat has one);
whose step takes nothing the batch cannot pad (Gemma 3's 4-D image mask: mlx-vlm's own
batch refuses its image prompts too); and no image attended both ways (the large Gemma 4
layouts: their images go whole, a chunk each, worker/vision/spans.py). The rest go one by
one, as before.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.generate.ar import _is_sequence_aligned_prompt_kwarg as aligned
from mlx_vlm.generate.ar import _left_pad_prompts as left_pad
from mlx_vlm.generate.ar import _make_cache as batch_caches
from mlx_vlm.generate.ar import _merge_prefill_prompt_kwargs as merge_rows
from mlx_vlm.generate.ar import _pad_sequence_aligned_prompt_kwarg as pad_to
from mlx_vlm.generate.ar import _slice_sequence_aligned_prompt_kwarg as cut

from worker.loop.mlx_lm_patches import bucket_pad, bucket_rows

# What an image prompt's step may take, beside its embeddings, and go in a batch: each
# a row of its own (Qwen's 3-D positions and position deltas, Gemma 4's per-layer inputs).
PADDABLE = frozenset({"position_ids", "rope_deltas", "per_layer_inputs"})


def groupable(job) -> bool:
    """Whether `job` (embedded: its `extra` known, batch.py `_Prefill`) has a step that a
    batch can take with others' (the module's doc)."""
    return not job.whole and set(job.extra) <= PADDABLE


class Together:
    """Image prompts' prefills (`_Prefill`s, embedded, from nothing) as one left-padded
    batch on mlx-vlm's batch caches, through each one's `end`."""

    def __init__(self, lm, jobs: list, positions: int | None = None):
        self.lm, self.jobs = lm, jobs
        ids = [list(job.prep.ids[:job.end]) for job in jobs]
        longest = max(len(i) for i in ids)
        self.width = longest + bucket_pad(longest)
        rows = [{"inputs_embeds": job.embeds[:, :job.end],
                 **{k: cut(k, v, stop=job.end) if aligned(k, v, job.embeds.shape[1]) else v
                    for k, v in job.extra.items()}} for job in jobs]
        extra = bucket_rows(len(jobs), self.width, positions) - len(jobs)
        ids, rows = ids + [ids[-1]] * extra, rows + [rows[-1]] * extra  # (never read)
        self.pad = [self.width - len(i) for i in ids]
        self.embeds, self.kwargs = merge_rows(rows, ids)
        if self.width > longest:  # (CUDA: each row's left padding grows by as much)
            self.embeds = pad_to("inputs_embeds", self.embeds, self.width, left=True)
            self.kwargs = {k: pad_to(k, v, self.width, left=True)
                           if aligned(k, v, longest) else v for k, v in self.kwargs.items()}
        self.inputs = left_pad(ids, self.width)
        self.cache = batch_caches(lm, self.pad)
        self.done = 0  # columns prefilled

    def column(self, job, point: int) -> int:
        """The batch's column after `job`'s first `point` prompt tokens."""
        return self.pad[self.jobs.index(job)] + point

    def run_to(self, column: int) -> None:
        """Prefill every row through `column` (one forward pass)."""
        a, b = self.done, column
        kwargs = {k: cut(k, v, start=a, stop=b) if aligned(k, v, self.width) else v
                  for k, v in self.kwargs.items()}
        self.lm(self.inputs[:, a:b], inputs_embeds=self.embeds[:, a:b], cache=self.cache,
                n_to_process=b - a, **kwargs)
        mx.eval([c.state for c in self.cache])
        self.done = b

    def state(self, job) -> list:
        """`job`'s row of the caches as it stands: mlx-vlm's caches of one prompt."""
        i = self.jobs.index(job)
        return [c.extract(i) for c in self.cache]
