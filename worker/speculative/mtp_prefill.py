"""The MTP head reads the prompt (worker/speculative/mtp.py): the target's final hidden
states of every prompt position, kept as mlx-lm's prompt batch prefills it.

mlx-lm's BatchGenerator prefills a prompt in chunks (`PromptProcessingBatch.prompt`, one
chunk a step: worker/loop/batch.py) and keeps only the KV cache: the model's output is
never read, and its last layers' computation past what the cache needs is never done.
Then `PromptProcessingBatch.generate` reads the prompt's last token in the step that
samples the first one. For a sequence drafting with the MTP head, both calls run the
target as its body and its LM head (`Prefill`, the prompt batch's model while the
generator speculates with the head), the same computation as the model's call, and
hand the body's hidden states to the head: each chunk's positions go into the
sequence's own head cache (`MTPSpeculation.prefilled`: one pass of the head over the
chunk, as wide as the target's, evaluated with it), and once its first token is
sampled the head reads the last positions and drafts (`MTPSpeculation.started`), so
the sequence's first verify step already has a draft made over its whole prompt. The
cost is the head's layer over the prompt (and the target's last layer and norm over
each chunk, which the cache alone does not need): no second forward of the target. On
tests/mtp_model.py's tiny checkpoint (4 layers, the last its one attention layer), a
730-token prompt prefilled in 0.29-0.31 s for the cache alone, 0.35-0.39 s with the
hidden states, 0.38-0.40 s with the head's pass too (this CPU, best of 3 runs each):
about a layer of 4; on a real checkpoint's 48 or 64 layers, about two of them.

Only the tokens the batch prefills: a prompt resumed from the prefix cache starts its
head from the head's state kept with the cached part (mtp_state.py), or, where the entry
has none (trimmed), gives the head its new part only, as an image prefilled by mlx-vlm
does (worker/vision/batch.py).

The one prompt prefilled outside the batch, the operator's --warm-prompt (worker/kvcache/
warm.py, pinned before the worker is ready), is read the same way (`PromptReader`): each
chunk through the target's body and the head's own cache, so its pinned entry carries
the head's state (mtp_state.py) and a conversation that starts from it resumes its head
whole; without it that conversation's head cache would start past position 0, and none
of its later entries could carry one.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch

from worker.speculative import mtp_state


class Prefill:
    """The target as the prompt batch calls it, while some rows' hidden states are wanted
    (`reading`): body, then LM head, the hidden states handed on; otherwise the model
    itself. Everything else is the model's."""

    def __init__(self, model, speculation):
        self.model = model
        self.speculation = speculation
        self.rows = None     # (uids, each row's tokens: None, only keep `hidden`) of the
                             # call being read
        self.at = 0          # the position in those tokens the next chunk starts at
        self.hidden = None   # the last chunk's hidden states

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    @contextmanager
    def reading(self, uids: list, tokens: list | None):
        self.rows, self.at, self.hidden = (list(uids), tokens), 0, None
        try:
            yield
        finally:
            self.rows = None

    def __call__(self, inputs, cache=None, **kwargs):
        if self.rows is None:
            return self.model(inputs, cache=cache, **kwargs)
        spec = self.speculation
        self.hidden = spec.body(inputs, cache=cache)
        uids, tokens = self.rows
        if tokens is None:
            return spec.lm_head(self.hidden)
        end = self.at + inputs.shape[1]
        more = spec.prefilled(uids, [t[self.at:end] for t in tokens], self.hidden)
        self.at = end
        if more:  # (with the chunk: mlx-lm evaluates its cache right after)
            mx.async_eval(more)
        return spec.lm_head(self.hidden)


class PromptReader:
    """A prompt prefilled outside the batch (the warm prompt: module doc) as `Prefill`
    prefills one drafting with the head: the target's body into the model's cache, its
    hidden states read by a head cache of this reader's own (`MTPSpeculation.read`, as
    for a row of the batch: `prefilled`); `state` is then the head's state beside the
    target's, as the KV cache keeps it. MLX thread."""

    def __init__(self, speculation):
        self.speculation = speculation
        self.drafter = speculation.drafter()  # (never a track of the batch: no row)

    def __call__(self, ids: list, cache: list) -> list:
        """The next chunk `ids` through the target into `cache` and through the head: the
        head's arrays to evaluate with the cache (the LM head is not run: no logits are
        read)."""
        spec = self.speculation
        return spec.read(self.drafter, ids, spec.body(mx.array(ids)[None], cache=cache))

    def state(self, tokens: int) -> list | None:
        """The head's state beside the target's state of the `tokens` read (lazy)."""
        return mtp_state.state_of(self.speculation, self.drafter, tokens)


def install() -> None:
    """`PromptProcessingBatch.prompt` and `generate` read the rows' hidden states where
    the batch's model is a `Prefill`; mlx-lm's own otherwise."""
    prompt, generate = PromptProcessingBatch.prompt, PromptProcessingBatch.generate
    if getattr(prompt, "mlxd_mtp", False):
        return

    @functools.wraps(prompt)
    def read_prompt(self, tokens):
        model = self.model
        if not isinstance(model, Prefill) or not tokens:
            return prompt(self, tokens)
        with model.reading(self.uids, tokens):
            return prompt(self, tokens)

    @functools.wraps(generate)
    def read_first(self, tokens):
        model = self.model
        if not isinstance(model, Prefill) or not self.uids:
            return generate(self, tokens)
        if any(len(t) > 1 for t in tokens):  # (mlx-lm's own split, read as a chunk)
            self.prompt([t[:-1] for t in tokens])
            tokens = [t[-1:] for t in tokens]
        uids = list(self.uids)
        with model.reading(uids, None):
            batch = generate(self, tokens)
        if model.hidden is not None:
            model.speculation.started(uids, [t[-1] for t in tokens], model.hidden,
                                      batch._next_tokens)
        model.hidden = None
        return batch

    read_prompt.mlxd_mtp = True
    PromptProcessingBatch.prompt = read_prompt
    PromptProcessingBatch.generate = read_first


install()
