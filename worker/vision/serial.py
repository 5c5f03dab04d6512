"""A vision model's requests, one at a time: the scheduler's batch interface over
mlx-vlm's `generate_step`.

mlx-vlm's generation step runs one sequence (its vision tower, its multimodal rotary
positions and their per-prompt state live on the model object), so a vision worker
announces one slot; requests queue in the scheduler as they do for a full text batch.
Each `step()` advances the running sequence by one token (the first one also prefills
the whole prompt, images included, in chunks of the engine's prefill step inside
mlx-vlm's step) and feeds it to the sequence's Decoding, so stop strings, logprobs,
grammars, reasoning and tool calls behave as in the text batch; a cancel drops the
sequence between tokens, so one that comes during the prefill waits for its end (the
text batch, prefilling a chunk per step, sees it sooner). No prompt cache: an image's
tokens depend on the image, not on its token ids (a follow-up prefills its whole prompt).
"""

from __future__ import annotations

from typing import Optional

from protocol.messages import CacheStats
from worker.vision.engine import model_inputs, warm_requests


class _Warm:
    """What the batch needs of a sequence, for the warm-up's."""
    uid = None


class SerialBatch:
    max_size = 1
    kvcache = None     # no prompt cache (see the docstring)
    scores_prompts = False  # no echo with logprobs (worker/loop/echo.py)
    shares_prompts = False  # no prefix cache: each request prefills its own prompt

    def __init__(self, engine):
        self.engine = engine
        self.members: dict[int, tuple] = {}   # uid → (seq, decoding): at most one
        self._steps = None                      # the running sequence's generate_step
        self._uid = 0

    def __len__(self) -> int:
        return len(self.members)

    def fits(self, prep) -> bool:
        return not self.members

    def idle(self) -> None:
        """(Between requests: nothing to do; Batch.idle says who does something.)"""

    def add(self, seq, prep) -> int:
        """Start `prep` (after `fits`); returns the prompt tokens cached: none."""
        import mlx.core as mx
        from mlx_vlm.generate.ar import generate_step

        engine = self.engine
        decoding = engine.decoding(prep)
        processors = engine.processors(prep)
        if decoding.grammar is not None:
            processors.append(decoding.grammar)
        pixels, mask, kwargs = model_inputs(prep.media)
        self._steps = generate_step(
            mx.array(prep.ids)[None], engine.vlm, pixels, mask,
            max_tokens=decoding.budget, sampler=engine.sampler(prep),
            logits_processors=processors, prefill_step_size=engine.prefill_step, **kwargs)
        self._uid += 1
        seq.uid = self._uid
        self.members[self._uid] = (seq, decoding)
        return 0

    def step(self) -> list:
        """[(seq, outcome)]: the running sequence's next token through its Decoding (or
        the exception that ended it, as the text batch reports it)."""
        if not self.members:
            return []
        uid, (seq, decoding) = next(iter(self.members.items()))
        token, logprobs = next(self._steps)  # raises: the step failed (the scheduler's)
        try:
            out = decoding.feed(int(token), logprobs)
        except Exception as e:
            self._end(uid)
            return [(seq, e)]
        if out[2] is not None:  # finished: EOS, a stop, its budget or a complete grammar
            self._end(uid)
        return [(seq, out)]

    def _end(self, uid: int) -> None:
        self.members.pop(uid, None)
        if self._steps is not None:
            self._steps.close()
        self._steps = None

    def remove(self, seq) -> None:
        uid = getattr(seq, "uid", None)
        if uid in self.members:
            self._end(uid)

    def reset(self) -> list:
        seqs = [s for s, _ in self.members.values()]
        for uid in list(self.members):
            self._end(uid)
        return seqs

    def warm(self) -> None:
        """A short text request and a short image request before Ready, so the first
        client request pays no compile."""
        for gen in warm_requests(self.engine.hearing is not None):
            self.add(_Warm(), self.engine.prepare(gen))
            while self.members:
                self.step()

    def cache_stats(self) -> Optional[CacheStats]:
        return None

    def close(self) -> None:
        self.reset()
