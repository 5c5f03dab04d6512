"""Bodies of the pooling routes → their protocol Generate: /v1/embeddings (OpenAI's
CreateEmbeddingRequest) and /v1/rerank (the Jina/Cohere shape that llama-server and vLLM
serve).

Same rules as the other parsers (api/fields/params.py): `null` is "not given", unknown fields are
ignored, every refusal is a 400 naming its parameter. Counts are capped as OpenAI caps
them (2048 inputs per embeddings request), so one request cannot queue unbounded work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from protocol.messages import Generate, Task, pack_ids
from supervisor.api.fields.limits import check_length
from supervisor.api.fields.params import (all_ints, invalid_type, invalid_value, missing,
                                         opt_bool, opt_int, opt_str, parse_model, token_ids)

MAX_INPUTS = 2048          # OpenAI's limit on an embeddings request's array
MAX_DOCUMENTS = 1024       # rerank documents per request
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    texts: Optional[tuple[str, ...]]          # exactly one of texts and ids
    ids: Optional[tuple[tuple[int, ...], ...]]
    encoding_format: str
    dimensions: Optional[int]

    def to_generate(self) -> Generate:
        return Generate(rid="", task=Task.EMBED,
                        inputs=list(self.texts) if self.texts is not None else None,
                        input_ids=[pack_ids(i) for i in self.ids] if self.ids is not None
                        else None, dimensions=self.dimensions)


def parse_embeddings_request(body: dict) -> EmbeddingsRequest:
    model = parse_model(body)
    if body.get("input") is None:
        raise missing("input")
    texts, ids = _parse_input(body["input"])
    fmt = opt_str(body, "encoding_format") or "float"
    if fmt not in ENCODINGS:
        raise invalid_value("encoding_format", f"expected one of {', '.join(ENCODINGS)}, "
                            f"got '{fmt}'.")
    opt_str(body, "user")
    return EmbeddingsRequest(model, texts, ids, fmt, opt_int(body, "dimensions", minimum=1))


def _parse_input(value) -> tuple[Optional[tuple], Optional[tuple]]:
    """A string, an array of strings, an array of token ids, or an array of such arrays
    (OpenAI's four forms); never mixed, never empty."""
    expected = "a string, an array of strings, an array of integers or an array of arrays"
    if isinstance(value, str):
        if not value:
            raise invalid_value("input", "expected a non-empty string.")
        return (value,), None
    if not isinstance(value, list):
        raise invalid_type("input", expected, value)
    _non_empty("input", value, MAX_INPUTS)
    if all_ints(value):
        return None, (token_ids(value, "input"),)
    if all(isinstance(t, str) for t in value):
        return _texts(value), None
    if all(isinstance(t, list) for t in value):
        rows = []
        for n, row in enumerate(value):
            if not row or not all_ints(row):
                raise invalid_type(f"input[{n}]", "a non-empty array of integers", row)
            rows.append(token_ids(row, f"input[{n}]"))
        return None, tuple(rows)
    raise invalid_type("input", expected, value)


def _non_empty(param: str, value: list, limit: int) -> None:
    if not value:
        raise invalid_value(param, "empty array. Expected an array with minimum length 1, "
                            "but got an empty array instead.", "empty_array")
    check_length(param, value, limit)


def _texts(values: list[str]) -> tuple[str, ...]:
    for n, text in enumerate(values):
        if not text:
            raise invalid_value(f"input[{n}]", "expected a non-empty string.")
    return tuple(values)


@dataclass(frozen=True)
class RerankRequest:
    model: str
    query: str
    documents: tuple[str, ...]
    top_n: Optional[int]
    return_documents: bool

    def to_generate(self) -> Generate:
        return Generate(rid="", task=Task.SCORE, prompt=self.query,
                        inputs=list(self.documents))


def parse_rerank_request(body: dict) -> RerankRequest:
    model = parse_model(body)
    query = opt_str(body, "query")
    if not query:
        raise missing("query") if query is None else invalid_value(
            "query", "expected a non-empty string.")
    docs = body.get("documents")
    if docs is None:
        raise missing("documents")
    if not isinstance(docs, list):
        raise invalid_type("documents", "an array", docs)
    _non_empty("documents", docs, MAX_DOCUMENTS)
    texts = []
    for n, doc in enumerate(docs):
        # Cohere and Jina also take {"text": ...} objects.
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise invalid_type(f"documents[{n}]", "a string or an object with a string "
                               "`text`", doc)
        texts.append(text)
    top_n = opt_int(body, "top_n", minimum=1)
    return_documents = opt_bool(body, "return_documents")
    return RerankRequest(model, query, tuple(texts), top_n,
                         True if return_documents is None else return_documents)
