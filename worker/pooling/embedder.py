"""The embedding engine: an encoder (or a causal LM trained for embeddings) from
mlx-embeddings, pooled as the model's own configuration says (pooling_config.py).

`prepare` (preparation thread, no MLX) tokenizes and checks every input; `run` (the MLX
thread) embeds one padded batch of them. Rows are padded on the right with an attention
mask, so a row's vector does not depend on what it is batched with (up to float rounding).
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np

from protocol.messages import (CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, ModelKind, Task,
                               unpack_ids)
from worker.text import tokens
from worker.pooling import pooling_config
from worker.pooling.jobs import Job, padded
from worker.errors import RequestError

log = logging.getLogger("worker.embed")


class EmbedEngine:
    kind = ModelKind.EMBED

    def __init__(self, model, tokenizer, context_length: int, pooling: pooling_config.Pooling,
                 dim: int, vocab_size: int):
        self.model = model
        self.tokenizer = tokenizer        # a transformers tokenizer
        self.context_length = context_length
        self.pooling = pooling
        self.dim = dim
        self.vocab_size = vocab_size
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0

    @classmethod
    def load(cls, path: Path, config: dict, context_length: int) -> "EmbedEngine":
        from mlx_embeddings.utils import load_model
        from transformers import AutoTokenizer

        pooling = pooling_config.read(path, config)
        model = load_model(Path(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        engine = cls(model, tokenizer, context_length, pooling, 0,
                     config.get("vocab_size") or len(tokenizer))
        engine.dim = engine.run([[engine._any_token()]]).shape[1]  # measured, not assumed
        return engine

    def _any_token(self) -> int:
        ids = self.tokenizer.encode("a", add_special_tokens=True)
        return ids[0] if ids else 0

    # ---- preparation (no MLX) -------------------------------------------------------
    def prepare(self, gen) -> Job | tokens.Answered:
        if gen.task is not Task.EMBED:
            return tokens.answer(gen, self, self.kind)
        if gen.input_ids is not None:
            rows = [unpack_ids(b) for b in gen.input_ids]
            for n, row in enumerate(rows):
                bad = [i for i in row if i >= self.vocab_size]
                if bad:
                    raise RequestError(INVALID_REQUEST, f"input[{n}]: token id {bad[0]} is out "
                                       f"of range: the vocabulary has {self.vocab_size} tokens",
                                       "input")
        else:
            rows = [list(self.tokenizer.encode(t, add_special_tokens=True))
                    for t in gen.inputs or []]
        if not rows:
            raise RequestError(INVALID_REQUEST, "input must not be empty", "input")
        for n, row in enumerate(rows):
            if not row:
                raise RequestError(INVALID_REQUEST, f"input[{n}] is empty", "input")
            if len(row) > self.context_length:
                raise RequestError(
                    CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {self.context_length} tokens, "
                    f"however input[{n}] has {len(row)} tokens. Please reduce its length.",
                    "input", sum(len(r) for r in rows))
        self._check_dimensions(gen.dimensions)
        return Job(gen, rows, self.dim)

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        widths = self.pooling.matryoshka
        if widths is None:
            raise RequestError(INVALID_REQUEST, "This model does not support `dimensions`: it "
                               "was not trained for shortened (Matryoshka) embeddings.",
                               "dimensions")
        if dimensions > self.dim or (widths and dimensions not in widths):
            allowed = ", ".join(map(str, widths)) if widths else f"1 to {self.dim}"
            raise RequestError(INVALID_REQUEST, f"`dimensions` must be one of {allowed} for "
                               f"this model, got {dimensions}.", "dimensions")

    def prompt_ids(self, gen, bound: bool = False) -> tuple[list[int], str]:
        """TOKENIZE for an embedding model: the text as it would be embedded."""
        if gen.prompt is None:
            raise RequestError(INVALID_REQUEST, "an embedding model tokenizes a `prompt` "
                               "(it has no chat template for messages)", "messages")
        return list(self.tokenizer.encode(gen.prompt, add_special_tokens=True)), "prompt"

    def token_bytes(self, tok: int) -> bytes:
        return self.tokenizer.decode([tok]).encode("utf-8")

    # ---- compute (the MLX thread) ---------------------------------------------------
    def run(self, rows: list[list[int]], types=None) -> np.ndarray:
        """Vectors (len(rows), dim) for one batch, as float32 (`types`: unused, one
        segment)."""
        ids, mask = padded(rows, self.pad_id)
        mask_mx = mx.array(mask)
        out = self.model(mx.array(ids), attention_mask=mask_mx)
        vec = self.pooling.pool(out, mask_mx).astype(mx.float32)
        mx.eval(vec)
        return np.array(vec)

    def finish(self, job: Job) -> np.ndarray:
        """The job's rows, shortened to `dimensions` and renormalised if asked."""
        out = job.out
        d = job.gen.dimensions
        if d is not None and d < out.shape[1]:
            out = out[:, :d]
            out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def probe(self) -> None:
        self.run([[self._any_token()]])
