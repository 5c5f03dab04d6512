"""The rerank engine for causal-LM rerankers (the Qwen3-Reranker recipe): the model reads
an instruction, the query and one document through its own chat template, and the
relevance score is the probability it gives "yes" over "no" as its next token.

Rows are right-padded into one batch: in a causal model no real position attends to the
padding after it, so the logits at each row's last real token are exactly those of the row
run alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from protocol.messages import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, ModelKind, Task
from worker.text import tokens
from worker.pooling.jobs import Job, padded
from worker.errors import RequestError

# The recipe's words (Qwen3-Reranker's model card); the instruction is its default.
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class RerankLoadError(Exception):
    """The model cannot judge yes/no with one token each."""


class LMReranker:
    kind = ModelKind.RERANK

    def __init__(self, model, tokenizer, context_length: int, vocab_size: int):
        self.model = model
        self.tokenizer = tokenizer     # mlx-lm TokenizerWrapper
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.dim = 1
        self.yes, self.no = self._answer_id("yes"), self._answer_id("no")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0

    def _answer_id(self, word: str) -> int:
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RerankLoadError(f"a reranker needs `{word}` to be one token of its "
                                  f"vocabulary; this tokenizer splits it into {len(ids)}")
        return ids[0]

    # ---- preparation (no MLX) -------------------------------------------------------
    def prepare(self, gen) -> Job | tokens.Answered:
        if gen.task is not Task.SCORE:
            return tokens.answer(gen, self, self.kind)
        if gen.prompt is None or not gen.inputs:
            raise RequestError(INVALID_REQUEST, "rerank needs a query and documents", "query")
        rows = [self._pair(gen.prompt, doc) for doc in gen.inputs]
        for n, row in enumerate(rows):
            if len(row) > self.context_length:
                raise RequestError(
                    CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {self.context_length} tokens, "
                    f"however the query with documents[{n}] makes {len(row)} tokens. Please "
                    "reduce the length of the query or the document.", "documents",
                    sum(len(r) for r in rows))
        return Job(gen, rows, 1)

    def _pair(self, query: str, document: str) -> list[int]:
        user = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        # enable_thinking=False: Qwen3 templates then close an empty think block, as the
        # recipe's prompt does; templates without the switch ignore it.
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True,
                                                  enable_thinking=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, gen, bound: bool = False) -> tuple[list[int], str]:
        if gen.prompt is None:
            raise RequestError(INVALID_REQUEST, "a reranker tokenizes a `prompt`", "messages")
        return list(self.tokenizer.encode(gen.prompt, add_special_tokens=False)), "prompt"

    def token_bytes(self, tok: int) -> bytes:
        return self.tokenizer.decode([tok]).encode("utf-8")

    # ---- compute (the MLX thread) ---------------------------------------------------
    def run(self, rows: list[list[int]], types=None) -> np.ndarray:
        """P(yes) against P(no) at each row's last token: (len(rows), 1) float32."""
        ids, mask = padded(rows, self.pad_id)
        logits = self.model(mx.array(ids))
        last = mx.array(mask.sum(axis=1) - 1)
        at = logits[mx.arange(len(rows)), last]                   # (rows, vocab)
        pair = mx.stack([at[:, self.no], at[:, self.yes]], axis=-1).astype(mx.float32)
        score = mx.softmax(pair, axis=-1)[:, 1:]
        mx.eval(score)
        return np.array(score)

    def finish(self, job: Job) -> np.ndarray:
        return job.out

    def probe(self) -> None:
        self.run([[self.yes]])
