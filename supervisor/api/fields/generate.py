"""A validated request → the parts of the one protocol `Generate` it becomes, for every surface.

Chat completions, legacy completions, Messages and the Responses API each parse their own
body (their folder's request.py); what they send to a worker is built once, from these
parts (the output spec: tools.py `output`), with the server's defaults (--default-max-tokens,
--default-temperature, --default-repetition-penalty) filling what the client left out.
Nothing downstream patches a Generate: the dispatcher only stamps its `rid`. So the
defaults have one place, and a new sampling option is one field of
protocol.SamplingParams plus its parsing.
"""

from __future__ import annotations

from typing import Optional

from protocol.messages import PromptCache, SamplingParams

# What the worker's logs call a snapshot named after a client's prompt_cache_key (the key
# may be a secret; a response id is not).
KEY_LABEL = "a prompt_cache_key snapshot"


def prompt_cache(key: Optional[str], *, response_id: Optional[str] = None,
                 previous_response_id: Optional[str] = None) -> PromptCache:
    """What a request asks of the worker's KV cache, for every surface: its namespace (the
    client's prompt_cache_key), and the named snapshot (worker/kvcache/) its final state is
    kept under and the one it resumes from. A prompt_cache_key conversation's snapshot is
    named "key:" + the key; a stored response's is its id (`response_id`, kept under it
    instead of the key's), and a response that continues one resumes from its previous
    response's (`previous_response_id`, before the key's). Only the Responses API has ids."""
    key_name = f"key:{key}" if key else None
    resume_from = previous_response_id or key_name
    return PromptCache(namespace=key, keep_as=response_id or key_name, resume_from=resume_from,
                       resume_label=previous_response_id or (KEY_LABEL if key_name else ""))


def sampling(config, *, max_tokens: Optional[int] = None,
             temperature: Optional[float] = None,
             repetition_penalty: Optional[float] = None,
             fallback_max_tokens: Optional[int] = None,
             logit_bias: Optional[dict] = None, **values) -> SamplingParams:
    """The request's sampling values, the server's defaults where it gave none.
    `config` holds the defaults (supervisor.config.Config); `fallback_max_tokens` is the
    endpoint's own default (legacy completions: 16), used when the server has none.
    `values`: the other SamplingParams fields, as given (None: the worker's default)."""
    if max_tokens is None:
        max_tokens = config.default_max_tokens or fallback_max_tokens
    if temperature is None:
        temperature = config.default_temperature
    if repetition_penalty is None:
        repetition_penalty = config.default_repetition_penalty
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature,
        repetition_penalty=repetition_penalty,
        logit_bias=tuple(logit_bias.items()) if logit_bias else (), **values)
