"""The rerank engine for cross-encoders: an encoder with a sequence-classification head
(BertForSequenceClassification: ms-marco MiniLM; XLMRobertaForSequenceClassification:
bge-reranker, jina-reranker), reading the query and a document as one pair.

mlx-embeddings runs the encoder; the head is small and lives here, loaded from the
checkpoint's `classifier.*` weights in the layout Hugging Face saves them: for BERT the
pooler (tanh of a dense layer on [CLS]) then one linear layer, for XLM-RoBERTa a dense
layer with tanh on <s> then `out_proj`. One label is a relevance logit (the score is its
sigmoid); two are (irrelevant, relevant) logits (the score is the softmax of the second),
as sentence-transformers' CrossEncoder reads them.

A document longer than the context is cut to fit (the query is kept whole), as
sentence-transformers does with its max_length: cross-encoders have short contexts (512)
and documents are routinely longer.
"""

from __future__ import annotations

import glob
import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from protocol.messages import INVALID_REQUEST, ModelKind, Task
from worker.text import tokens
from worker.pooling.jobs import Job, padded
from worker.errors import RequestError

# Hugging Face architecture → (mlx-embeddings module, the checkpoint's encoder prefix).
ARCHITECTURES = {
    "BertForSequenceClassification": ("bert", "bert."),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", "roberta."),
}


class CrossEncoderLoadError(Exception):
    """A classification model mlxd cannot run as a reranker."""


class RobertaHead(nn.Module):
    """XLM-RoBERTa's classification head: dense + tanh on <s>, then the labels."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def __call__(self, out) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(out.last_hidden_state[:, 0])))


class BertHead(nn.Module):
    """BERT's: one linear layer on the pooler's output (the encoder runs the pooler)."""

    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.classifier = nn.Linear(hidden, labels)

    def __call__(self, out) -> mx.array:
        return self.classifier(out.pooler_output)


class CrossEncoder:
    kind = ModelKind.RERANK

    def __init__(self, encoder, head: nn.Module, tokenizer, context_length: int,
                 vocab_size: int, labels: int, segments: bool = False):
        self.encoder = encoder
        self.head = head
        self.segments = segments        # pairs are typed 0 and 1 (BERT)
        self.tokenizer = tokenizer      # a transformers tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.labels = labels
        self.dim = 1
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0

    @property
    def model(self):
        return self.encoder

    @classmethod
    def load(cls, path: Path, config: dict, context_length: int) -> "CrossEncoder":
        from transformers import AutoTokenizer

        archs = [a for a in config.get("architectures") or [] if a in ARCHITECTURES]
        if not archs:
            raise CrossEncoderLoadError(
                f"cross-encoders of {config.get('architectures')} are not supported (served: "
                f"{', '.join(ARCHITECTURES)})")
        module_name, prefix = ARCHITECTURES[archs[0]]
        labels = len(config.get("id2label") or {}) or config.get("num_labels") or 1
        if labels not in (1, 2):
            raise CrossEncoderLoadError(f"a reranker has 1 or 2 labels; this model has {labels}")
        weights = {}
        for file in sorted(glob.glob(str(Path(path) / "*.safetensors"))):
            weights.update(mx.load(file))
        head_weights = {k[len("classifier."):]: v for k, v in weights.items()
                        if k.startswith("classifier.")}
        body = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()
                if not k.startswith("classifier.") and "position_ids" not in k}
        module = importlib.import_module(f"mlx_embeddings.models.{module_name}")
        args = dict(config)
        if module_name == "xlm_roberta":  # the classification model has no pooler
            args["add_pooling_layer"] = any(k.startswith("pooler.") for k in body)
        encoder = module.Model(module.ModelArgs.from_dict(args))
        bert = module_name == "bert"
        head = (BertHead if bert else RobertaHead)(config["hidden_size"], labels)
        if bert:
            head_weights = {f"classifier.{k}": v for k, v in head_weights.items()}
        encoder.load_weights(list(body.items()))
        head.load_weights(list(head_weights.items()))
        encoder.eval()  # inference: dropout off (MLX modules start in training mode)
        mx.eval(encoder.parameters(), head.parameters())
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(encoder, head, tokenizer, context_length,
                   config.get("vocab_size") or len(tokenizer), labels,
                   segments=config.get("type_vocab_size", 1) > 1)

    # ---- preparation (no MLX) -------------------------------------------------------
    def prepare(self, gen) -> Job | tokens.Answered:
        if gen.task is not Task.SCORE:
            return tokens.answer(gen, self, self.kind)
        if gen.prompt is None or not gen.inputs:
            raise RequestError(INVALID_REQUEST, "rerank needs a query and documents", "query")
        enc = self.tokenizer([gen.prompt] * len(gen.inputs), list(gen.inputs),
                             truncation="only_second", max_length=self.context_length,
                             return_token_type_ids=self.segments)
        rows = [list(ids) for ids in enc["input_ids"]]
        if any(len(r) > self.context_length for r in rows):  # the query alone is too long
            raise RequestError(INVALID_REQUEST, f"the query does not fit this model's context "
                               f"of {self.context_length} tokens", "query")
        types = enc.get("token_type_ids")
        return Job(gen, rows, 1, types=[list(t) for t in types] if types else None)

    def prompt_ids(self, gen, bound: bool = False) -> tuple[list[int], str]:
        if gen.prompt is None:
            raise RequestError(INVALID_REQUEST, "a reranker tokenizes a `prompt`", "messages")
        return list(self.tokenizer.encode(gen.prompt, add_special_tokens=True)), "prompt"

    def token_bytes(self, tok: int) -> bytes:
        return self.tokenizer.decode([tok]).encode("utf-8")

    # ---- compute (the MLX thread) ---------------------------------------------------
    def run(self, rows: list[list[int]], types: list[list[int]] | None = None) -> np.ndarray:
        ids, mask = padded(rows, self.pad_id)
        kwargs = {}
        if types is not None:
            kwargs["token_type_ids"] = mx.array(padded(types, 0)[0])
        out = self.encoder(mx.array(ids), attention_mask=mx.array(mask), **kwargs)
        logits = self.head(out).astype(mx.float32)
        if self.labels == 1:
            score = mx.sigmoid(logits)
        else:
            score = mx.softmax(logits, axis=-1)[:, 1:]
        mx.eval(score)
        return np.array(score)

    def finish(self, job: Job) -> np.ndarray:
        return job.out

    def probe(self) -> None:
        self.run([[self.pad_id]])
