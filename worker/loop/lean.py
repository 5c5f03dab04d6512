"""The per-token Python a decode step of mlx-lm's batch pays and one stream need not.

Why: on a GPU a small model's decode step is the CPU building and launching the next
step's graph while the GPU runs the current one, so every microsecond of Python on the
MLX thread between two launches is a microsecond of the token's time (issue 36: the 0.5B
shape on an H200 decoded one stream at 0.93 x raw `stream_generate` in-process, ~0.3 ms a
token). Accounted on the CPU (`/tmp` probe: wall time per token less the model's graph,
MLX's launches and waits; tiny model, 512-token streams), mlx-lm's batch path spent about
twice the Python of `generate_step` per token: BatchGenerator's prompt bookkeeping run on
every step though nothing is being prefilled (the scheduling loops, its timers, an empty
`prompt([])` call), and GenerationBatch's per-row loops for a batch of one (the samplers
gathered and compared, the logits processors asked, `list(logprobs)`: an iterator that
indexes each row, ~4x a squeeze).

Each change here is the same computation with less Python, only in the case it names, and
falls back to mlx-lm's own code otherwise (tests/worker/test_worker_batching.py compares
the batch's output with mlx-lm's). `apply()` runs before worker/loop/mlx_lm_patches.py's
lone-sequence wrapper, which then calls the lean step.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch


# mlx-lm's own methods, which the lean ones fall back to (module-level: a test counts them).
ORIGINAL: dict = {}
# False: mlx-lm's own methods for every step (bench.single_ab --mlx-lm-steps compares).
ON = True


def apply() -> None:
    _decode_only_steps_skip_the_prompt_bookkeeping()
    _one_row_steps_without_the_row_loops()


def _decode_only_steps_skip_the_prompt_bookkeeping() -> None:
    """BatchGenerator._next when nothing waits to be prefilled or is being prefilled:
    only its generation part (the step and its counters, mlx-lm's buffer-cache release
    every 512 steps). The rest of `_next` would find nothing to move, split or prefill."""
    if getattr(BatchGenerator._next, "mlxd_lean", False):
        return
    ORIGINAL["next"] = BatchGenerator._next

    def _next(self):
        gb = self._generation_batch
        if not ON or self._unprocessed_sequences or self._currently_processing \
                or len(self._prompt_batch) or not len(gb):
            return ORIGINAL["next"](self)
        counters = self._counters
        tic = time.perf_counter()
        responses = gb.next()
        counters.decode_time += time.perf_counter() - tic
        counters.generation_tokens += len(responses)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            mx.clear_cache()
        return [], responses

    _next.mlxd_lean = True
    BatchGenerator._next = _next


def _one_row_steps_without_the_row_loops() -> None:
    """GenerationBatch._step for a batch of one sequence without logits processors: the
    same forward, normalization, sampler and pipelining (the next token launched before
    the current one is read), without the per-row lists a batch of one does not need."""
    if getattr(GenerationBatch._step, "mlxd_lean", False):
        return
    ORIGINAL["step"] = GenerationBatch._step

    def _step(self):
        processors = self.logits_processors
        if not ON or len(self.uids) != 1 or (processors and processors[0]):
            return ORIGINAL["step"](self)
        inputs = self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = self.samplers[0] if self.samplers else None
        if sampler is None:
            sampler = self.fallback_sampler
        self._next_tokens = sampler(logprobs)
        self._next_logprobs = [logprobs.squeeze(0)]
        mx.async_eval(self._next_tokens, self._next_logprobs)
        mx.eval(inputs, self._current_logprobs)
        tokens = inputs.tolist()
        self.tokens[0].append(tokens[0])
        return tokens, self._current_logprobs

    _step.mlxd_lean = True
    GenerationBatch._step = _step
