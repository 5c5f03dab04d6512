"""What a request must satisfy before it queues on a model, and what it gets if it
cannot even be sent to the worker.

The surface validates each parameter on its own (api/fields/params.py) and refuses values that
cannot travel at all (http/values.py); what depends on the model — its context length and
vocabulary, known once a worker was ready — is checked here, at submit, so an absurd
`top_k` or `max_tokens` is a 400 before it waits in any queue.
"""

from __future__ import annotations

import logging

from protocol import TASKS_OF, EncodeError, ModelKind, SamplingParams, Task
from protocol.messages import task_refusal
from supervisor.workers.errors import BadRequest, ContextTooLong, Internal, WorkerError

log = logging.getLogger("mlxd.runner")


def check_limits(sampling: SamplingParams, params: dict, context_length: int | None,
                 vocab_size: int | None) -> None:
    """Refuse integers outside their meaningful range for this model, before they
    queue. Known once a worker was ready; until then the worker checks them itself.
    `params` maps a field to the name the client's API gave it."""
    ctx, vocab = context_length, vocab_size
    max_tokens = None if sampling.max_tokens_ceiling else sampling.max_tokens
    if ctx and max_tokens is not None and max_tokens > ctx:
        # Whatever the prompt, it cannot fit: OpenAI's code for it, before any queueing.
        name = params.get("max_tokens", "max_tokens")
        raise ContextTooLong(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{max_tokens} tokens in the completion alone ({name}). Please reduce {name}.",
            name)
    if not vocab:
        return
    top_k = sampling.top_k
    if top_k is not None and top_k > vocab:
        name = params.get("top_k", "top_k")
        raise BadRequest(
            f"Invalid value for '{name}': integer above maximum value. This model's "
            f"vocabulary has {vocab} tokens, so top_k must be at most {vocab}, but got "
            f"{top_k} instead.", name, "integer_above_max_value")
    for token, _ in sampling.logit_bias:
        if not 0 <= token < vocab:
            name = params.get("logit_bias", "logit_bias")
            raise BadRequest(
                f"Invalid value for '{name}': token id {token} is out of range: this "
                f"model's vocabulary has {vocab} tokens (ids 0 to {vocab - 1}).",
                name, "invalid_value")


def check_task(model: str, task: Task, kind: ModelKind | None) -> None:
    """Refuse a task the model's kind cannot do (an embedding model asked to chat, a chat
    model asked to rerank), before it queues. Known once a worker was ready; until then
    the worker refuses it itself, in the same words."""
    if kind is not None and task not in TASKS_OF[kind]:
        raise BadRequest(task_refusal(model, task, kind), "model", "model_not_supported")


def unsendable(e: Exception) -> WorkerError:
    """The error for a request that could not be sent to its worker. The surface refuses
    values that cannot travel before this (a 400 naming the parameter); this is the
    guard behind it, so a field added later cannot wedge a model."""
    if isinstance(e, EncodeError):
        log.warning("a request could not be encoded for the worker: %s", e)
        return BadRequest(f"The request holds a value this server cannot process ({e}).",
                          e.field)
    log.error("a request could not be sent to the worker", exc_info=e)
    return Internal()
