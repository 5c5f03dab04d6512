"""POST /v1/completions (legacy text completions): the body → a validated CompletionRequest.

One prompt per request: a string, a list of one string, or token ids (a list of ints, or a
list holding one such list). Batches are a 400 rather than a silent first-only answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from protocol.messages import Generate, pack_ids
from supervisor.api.fields import generate as build
from supervisor.api.fields import tools as tooling
from supervisor.api.fields.params import (
    CommonParams, all_ints, invalid_type, invalid_value, missing, opt_bool, opt_int, opt_str,
    parse_common, token_ids, unsupported,
)

# OpenAI's default for /v1/completions (CreateCompletionRequest.max_tokens.default).
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(CommonParams):
    prompt: Optional[str] = None
    prompt_ids: Optional[tuple] = None      # token ids, when the client sent ids
    logprobs: Optional[int] = None          # alternatives per token (0..5); None: off
    # OpenAI's max_tokens default for this endpoint, used when neither the client nor
    # the server (--default-max-tokens) sets one.
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    def to_generate(self, config) -> Generate:
        """The request as the worker gets it (less its rid), with the server's defaults
        from `config` (supervisor/api/fields/generate.py)."""
        return Generate(
            rid="",
            prompt=self.prompt,
            prompt_ids=pack_ids(self.prompt_ids) if self.prompt_ids is not None else None,
            sampling=self.sampling(config, fallback_max_tokens=self.default_max_tokens),
            output=tooling.output((), tooling.ToolChoice(), tooling.ResponseFormat(),
                                stop=self.stop, logprobs=self.logprobs is not None,
                                top_logprobs=self.logprobs or 0),
            cache=build.prompt_cache(self.prompt_cache_key),
        )


def parse_completion_request(body: dict) -> CompletionRequest:
    """Validate a completions body; raises APIError(400) naming the bad param."""
    common = parse_common(body)
    prompt, prompt_ids = _parse_prompt(body)
    # max_tokens: the spec allows 0 (with echo, prompt only); no echo here, so 0 is useless.
    max_tokens = opt_int(body, "max_tokens", minimum=1)
    _reject_unsupported(body)
    return CompletionRequest(
        **common,
        max_tokens=max_tokens,  # None: the server's default, else DEFAULT_MAX_TOKENS
        prompt=prompt,
        prompt_ids=prompt_ids,
        logprobs=opt_int(body, "logprobs", 0, 5),
    )


def _parse_prompt(body: dict) -> tuple[Optional[str], Optional[tuple]]:
    if body.get("prompt") is None:
        raise missing("prompt")
    value = body["prompt"]
    if isinstance(value, str):
        return value, None
    expected = "a string, an array of strings, an array of integers or an array of arrays"
    if not isinstance(value, list):
        raise invalid_type("prompt", expected, value)
    if not value:
        raise invalid_value("prompt", "empty array. Expected an array with minimum length 1, "
                            "but got an empty array instead.", "empty_array")
    if all_ints(value):
        return None, token_ids(value, "prompt")
    if all(isinstance(p, (str, list)) for p in value):
        if len(value) > 1:
            raise unsupported("prompt", "Only one prompt per request is supported by this "
                              "server; send one request per prompt.", "unsupported_value")
        only = value[0]
        if isinstance(only, str):
            return only, None
        if only and all_ints(only):
            return None, token_ids(only, "prompt[0]")
        raise invalid_type("prompt[0]", "a non-empty array of integers", only)
    raise invalid_type("prompt", expected, value)


def _reject_unsupported(body: dict) -> None:
    if opt_bool(body, "echo"):
        raise unsupported("echo", "echo is not supported by this server yet.")
    if opt_str(body, "suffix"):
        raise unsupported("suffix", "suffix (insertion) is not supported by this server yet.")
    best_of = opt_int(body, "best_of", minimum=0, maximum=20)
    if best_of is not None and best_of > 1:
        raise unsupported("best_of", "best_of > 1 is not supported by this server.",
                          "unsupported_value")
