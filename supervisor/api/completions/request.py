"""POST /v1/completions (legacy text completions): the body → a validated CompletionRequest.

The prompt: a string, token ids (a list of ints), or a batch of either (a list of strings
or of lists of ints, mixed as OpenAI allows); each prompt of a batch gets its `n` choices,
numbered prompt by prompt (api/choices.py), as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from protocol.messages import Generate, pack_ids
from supervisor.api.fields import generate as build
from supervisor.api.fields import limits
from supervisor.api.fields import tools as tooling
from supervisor.api.fields.params import (
    CommonParams, all_ints, invalid_type, invalid_value, missing, opt_bool, opt_int, opt_str,
    parse_common, token_ids, unsupported,
)

# OpenAI's default for /v1/completions (CreateCompletionRequest.max_tokens.default).
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(CommonParams):
    # One (text, None) or (None, token ids) pair per prompt, in the order sent.
    prompts: tuple = ((None, None),)
    logprobs: Optional[int] = None          # alternatives per token (0..5); None: off
    echo: bool = False                      # the prompt first (with its logprobs)
    special_tokens: bool = True             # `add_special_tokens` (vLLM's): BOS on a text
    # OpenAI's max_tokens default for this endpoint, used when neither the client nor
    # the server (--default-max-tokens) sets one.
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    def to_generates(self, config) -> list[Generate]:
        """One Generate per prompt (less its rid), with the server's defaults from
        `config` (supervisor/api/fields/generate.py)."""
        return [self.to_generate(config, i) for i in range(len(self.prompts))]

    def to_generate(self, config, index: int = 0) -> Generate:
        """Prompt `index` as the worker gets it."""
        text, ids = self.prompts[index]
        return Generate(
            rid="",
            prompt=text,
            prompt_ids=pack_ids(ids) if ids is not None else None,
            sampling=self.sampling(config, fallback_max_tokens=self.default_max_tokens),
            output=tooling.output((), tooling.ToolChoice(), tooling.ResponseFormat(),
                                stop=self.stop, logprobs=self.logprobs is not None,
                                top_logprobs=self.logprobs or 0, echo=self.echo),
            cache=build.prompt_cache(self.prompt_cache_key),
            special_tokens=self.special_tokens,
        )


def parse_completion_request(body: dict) -> CompletionRequest:
    """Validate a completions body; raises APIError(400) naming the bad param."""
    common = parse_common(body)
    prompts = _parse_prompts(body, common["n"])
    echo = bool(opt_bool(body, "echo"))
    # max_tokens: 0 only with echo (the spec's "prompt only": its text and logprobs).
    max_tokens = opt_int(body, "max_tokens", minimum=0 if echo else 1)
    _reject_unsupported(body)
    return CompletionRequest(
        **common,
        max_tokens=max_tokens,  # None: the server's default, else DEFAULT_MAX_TOKENS
        prompts=prompts,
        logprobs=opt_int(body, "logprobs", 0, 5),
        echo=echo,
        special_tokens=opt_bool(body, "add_special_tokens") is not False,
    )


def _parse_prompts(body: dict, n: int) -> tuple:
    """((text, None) or (None, ids), ...): one pair per prompt, within MAX_CHOICES prompts
    of `n` choices each."""
    if body.get("prompt") is None:
        raise missing("prompt")
    value = body["prompt"]
    if isinstance(value, str):
        return ((value, None),)
    expected = "a string, an array of strings, an array of integers or an array of arrays"
    if not isinstance(value, list):
        raise invalid_type("prompt", expected, value)
    if not value:
        raise invalid_value("prompt", "empty array. Expected an array with minimum length 1, "
                            "but got an empty array instead.", "empty_array")
    if all_ints(value):
        return ((None, token_ids(value, "prompt")),)
    if not all(isinstance(p, (str, list)) for p in value):
        raise invalid_type("prompt", expected, value)
    if len(value) * n > limits.MAX_CHOICES:
        raise invalid_value("prompt", f"{len(value)} prompts of {n} choices each: a request "
                            f"may ask for at most {limits.MAX_CHOICES} choices in all.",
                            "array_above_max_length")
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append((item, None))
        elif item and all_ints(item):
            prompts.append((None, token_ids(item, f"prompt[{i}]")))
        else:
            raise invalid_type(f"prompt[{i}]", "a string or a non-empty array of integers",
                               item)
    return tuple(prompts)


def _reject_unsupported(body: dict) -> None:
    if opt_str(body, "suffix"):
        raise unsupported("suffix", "suffix (insertion) is not supported by this server yet.")
    best_of = opt_int(body, "best_of", minimum=0, maximum=20)
    if best_of is not None and best_of > 1:
        raise unsupported("best_of", "best_of > 1 is not supported by this server.",
                          "unsupported_value")
