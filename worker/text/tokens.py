"""TOKENIZE and DETOKENIZE, answered during preparation, and the refusal of a task the
model's kind cannot do.

Both need only the tokenizer, so they are answered whole on the preparation thread
(worker/loop/preparer.py) and never join the batch: a client budgeting its context (or
Anthropic's count_tokens) gets its count even while every slot is decoding. TOKENIZE
counts exactly what a generation would see: the same `prompt_ids` the engine prefills
(chat template, tools and template switches applied), without the context check, since
counting a prompt that is too long is the point of asking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import (INVALID_REQUEST, TASKS_OF, ModelKind, Started, Task, Tokens,
                               pack_ids, task_refusal, unpack_ids)
from worker.errors import RequestError


@dataclass(frozen=True)
class Answered:
    """A task answered in preparation: the fields of its Tokens message."""
    ids: list[int]
    pieces: list[bytes] = field(default_factory=list)
    text: str = ""

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    def messages(self, epoch: int, rid: str) -> tuple[Started, Tokens]:
        """What goes out before its Done: Started (its count), then the result."""
        return (Started(epoch=epoch, rid=rid, prompt_tokens=self.prompt_tokens),
                Tokens(epoch=epoch, rid=rid, ids=pack_ids(self.ids), pieces=self.pieces,
                       text=self.text))


def check_task(gen, kind: ModelKind) -> None:
    """Refuse a task this kind of model cannot do (the supervisor refuses it at admission
    once it knows the kind; this covers what was sent before)."""
    if gen.task not in TASKS_OF[kind]:
        raise RequestError(INVALID_REQUEST, task_refusal(None, gen.task, kind), "model")


def answer(gen, engine, kind: ModelKind) -> Answered:
    """TOKENIZE or DETOKENIZE `gen` with `engine` (its `prompt_ids`, `token_bytes`,
    `tokenizer`, `vocab_size`); any other task this kind cannot do is refused."""
    check_task(gen, kind)
    if gen.task is Task.TOKENIZE:
        ids, _ = engine.prompt_ids(gen, bound=False)
        return Answered(ids, [engine.token_bytes(i) for i in ids])
    if gen.task is Task.DETOKENIZE:
        ids = unpack_ids(gen.prompt_ids or b"")
        bad = [i for i in ids if i >= engine.vocab_size]
        if bad:
            raise RequestError(INVALID_REQUEST, f"token id {bad[0]} is out of range: the "
                               f"vocabulary has {engine.vocab_size} tokens", "tokens")
        return Answered(ids, text=engine.tokenizer.decode(ids))
    raise RequestError(INVALID_REQUEST, f"task {gen.task} is not answered in preparation",
                       "task")


# What `/tokenizer_info` shows of a tokenizer (vLLM's endpoint, which lm-evaluation-harness's
# remote tokenizer reads: its special tokens, and the chat template it renders itself).
INFO_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")


def info(tokenizer) -> dict:
    """A model's tokenizer (an mlx-lm TokenizerWrapper or a transformers tokenizer; None)
    as Ready.tokenizer carries it: its special tokens as text, its chat template (the
    default one where it has several), the class's name."""
    if tokenizer is None:
        return {}
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    out = {"tokenizer_class": type(tok).__name__}
    for name in INFO_FIELDS:
        value = getattr(tok, name, None)
        if isinstance(value, dict):  # (named templates: the default one)
            value = value.get("default")
        if isinstance(value, str):
            out[name] = value
    return out
