"""Field readers and the parameters chat and text completions share.

Rules come from OpenAI's spec (CreateChatCompletionRequest, CreateCompletionRequest):
`null` means "not given" for every optional field (the spec marks them nullable), bools are
not numbers (JSON `true` is not 1), integers are not decimals, and every rejection is a 400
naming the offending `param`, worded the way OpenAI words them so clients that surface the
message read naturally. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from protocol.messages import SamplingParams
from supervisor.api.fields import generate as build
from supervisor.api.fields import limits
from supervisor.http.errors import APIError

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


# ---- errors, in OpenAI's words -------------------------------------------------------

def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def invalid_type(param: str, expected: str, value: Any) -> APIError:
    return APIError.bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {type_name(value)} instead.",
        param, "invalid_type")


def invalid_value(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError.bad_request(f"Invalid value for '{param}': {message}", param, code)


def missing(param: str) -> APIError:
    return APIError.bad_request(f"Missing required parameter: '{param}'.", param,
                                "missing_required_parameter")


def unsupported(param: str, message: str, code: str = "unsupported_parameter") -> APIError:
    return APIError.bad_request(message, param, code)


# ---- typed readers: absent or null → None ---------------------------------------------

def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def all_ints(values: list) -> bool:
    """Every item an int, not a bool (True for none): `is_int` over a list, in one pass
    that stays in C, since a prompt of token ids may hold tens of thousands."""
    return not set(map(type, values)) - {int}


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_range(param, value, minimum, maximum, exclusive_minimum, kind):
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        rel = ">" if exclusive_minimum else ">="
        raise invalid_value(param, f"{kind} below minimum value. Expected a value {rel} "
                            f"{minimum}, but got {value} instead.", f"{kind}_below_min_value")
    if maximum is not None and value > maximum:
        raise invalid_value(param, f"{kind} above maximum value. Expected a value <= "
                            f"{maximum}, but got {value} instead.", f"{kind}_above_max_value")


def opt_int(body: dict, key: str, minimum: Optional[int] = None,
            maximum: Optional[int] = None, param: Optional[str] = None) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    param = param or key
    if not is_int(value):
        raise invalid_type(param, "an integer", value)
    _check_range(param, value, minimum, maximum, False, "integer")
    return value


def opt_number(body: dict, key: str, minimum: Optional[float] = None,
               maximum: Optional[float] = None, exclusive_minimum: bool = False,
               param: Optional[str] = None) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    param = param or key
    if not is_number(value):
        raise invalid_type(param, "a number", value)
    _check_range(param, value, minimum, maximum, exclusive_minimum, "decimal")
    return float(value)


def opt_bool(body: dict, key: str, param: Optional[str] = None) -> Optional[bool]:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid_type(param or key, "a boolean", value)
    return value


def opt_str(body: dict, key: str, param: Optional[str] = None) -> Optional[str]:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(param or key, "a string", value)
    return value


def cache_key(body: dict) -> Optional[str]:
    """`prompt_cache_key`: a string of at most limits.MAX_CACHE_KEY_CHARS."""
    key = opt_str(body, "prompt_cache_key")
    limits.check_cache_key("prompt_cache_key", key)
    return key


def opt_object(body: dict, key: str, param: Optional[str] = None) -> Optional[dict]:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type(param or key, "an object", value)
    return value


def opt_list(body: dict, key: str, param: Optional[str] = None) -> Optional[list]:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid_type(param or key, "an array", value)
    return value


# ---- shared fields -------------------------------------------------------------------

UINT32 = 2 ** 32  # token ids travel as packed uint32 (protocol.pack_ids)


def token_ids(ids: list, param: str) -> tuple:
    """A list of ints (checked by the caller) as token ids: each must fit a uint32."""
    if not ids or (min(ids) >= 0 and max(ids) < UINT32):
        return tuple(ids)
    for i, t in enumerate(ids):  # the first offender, named
        if not 0 <= t < UINT32:
            raise invalid_value(f"{param}[{i}]", f"token ids are integers from 0 to "
                                f"{UINT32 - 1}, got {t}.")
    return tuple(ids)


def parse_model(body: dict) -> str:
    if body.get("model") is None:
        raise missing("model")
    model = body["model"]
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    if not model:
        raise invalid_value("model", "expected a non-empty string.")
    return model


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). stream_options without stream is a 400, as at OpenAI."""
    stream = bool(opt_bool(body, "stream"))
    options = opt_object(body, "stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise APIError.bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options", "invalid_value")
    include = opt_bool(options, "include_usage", "stream_options.include_usage")
    opt_bool(options, "include_obfuscation", "stream_options.include_obfuscation")
    return stream, bool(include)


def parse_stop(body: dict) -> tuple[str, ...]:
    """A string or up to 4 strings; empty strings would match at once, so they are 400s."""
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            raise invalid_value("stop", "stop sequences must not be empty strings.")
        limits.check_stop("stop", value)
        return (value,)
    if not isinstance(value, list):
        raise invalid_type("stop", "a string or an array of strings", value)
    if len(value) > 4:
        raise invalid_value("stop", f"array too long. Expected an array with maximum length "
                            f"4, but got an array with length {len(value)} instead.",
                            "array_above_max_length")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid_type(f"stop[{i}]", "a string", item)
        if not item:
            raise invalid_value(f"stop[{i}]", "stop sequences must not be empty strings.")
        limits.check_stop(f"stop[{i}]", item)
    return tuple(value)


def parse_n(body: dict) -> int:
    """How many choices to generate for the prompt (api/choices.py fans them out)."""
    n = opt_int(body, "n", minimum=1, maximum=limits.MAX_CHOICES)
    return 1 if n is None else n


def parse_logit_bias(body: dict) -> Optional[dict]:
    """{token id: bias in -100..100}, carried with int keys (JSON keys are strings)."""
    value = opt_object(body, "logit_bias")
    if value is None:
        return None
    limits.check_length("logit_bias", value, limits.MAX_LOGIT_BIAS)
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid_value("logit_bias", f"keys must be token ids, got {key!r}.")
        if not is_number(bias):
            raise invalid_type(f"logit_bias.{key}", "a number", bias)
        _check_range(f"logit_bias.{key}", bias, -100, 100, False, "decimal")
        out[int(key)] = bias
    return out


def parse_metadata(body: dict) -> Optional[dict]:
    value = opt_object(body, "metadata")
    if value is not None:
        limits.check_length("metadata", value, limits.MAX_METADATA)
        for key, item in value.items():
            if not isinstance(item, str):
                raise invalid_type(f"metadata.{key}", "a string", item)
    return value


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def parse_reasoning_effort(body: dict, key: str = "reasoning_effort",
                           param: Optional[str] = None) -> Optional[str]:
    effort = opt_str(body, key, param)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid_value(param or key, f"'{effort}'. Supported values are: "
                            + ", ".join(f"'{e}'" for e in REASONING_EFFORTS) + ".")
    return effort


@dataclass(frozen=True, kw_only=True)
class CommonParams:
    """What chat and text completions share. Sampling values are None when not given:
    the server's defaults, else the worker's, apply (protocol.messages.SamplingParams)."""
    model: str
    stream: bool = False
    include_usage: bool = False            # stream_options.include_usage
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None    # 0..2
    top_p: Optional[float] = None          # (0, 1]
    top_k: Optional[int] = None            # >= 0, 0 = off; not OpenAI, common locally
    min_p: Optional[float] = None          # 0..1; not OpenAI
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None  # > 0; not OpenAI
    stop: tuple = ()
    n: int = 1
    presence_penalty: Optional[float] = None    # -2..2, over the last 20 tokens (mlx-lm)
    frequency_penalty: Optional[float] = None   # -2..2, over the last 20 tokens (mlx-lm)
    logit_bias: Optional[dict] = None           # {token id: -100..100}
    max_tokens_ceiling: bool = False            # OpenAI's max_tokens is a demand (a 400 if
    #                                             it cannot fit); Anthropic's a ceiling
    user: Optional[str] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None

    def sampling(self, config, fallback_max_tokens: Optional[int] = None) -> SamplingParams:
        """The sampling values both endpoints send the same way, with the server's
        defaults (supervisor/api/fields/generate.py). Every SamplingParams field is a field
        of this class under the same name, so a new one is only parsed, never mapped."""
        values = {name: getattr(self, name) for name in SamplingParams.__struct_fields__}
        return build.sampling(config, fallback_max_tokens=fallback_max_tokens, **values)


def parse_common(body: dict) -> dict:
    """Keyword arguments for CommonParams, except max_tokens (each endpoint has its rule)."""
    model = parse_model(body)
    stream, include_usage = parse_stream(body)
    return {
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "temperature": opt_number(body, "temperature", 0, 2),
        # The spec allows top_p 0, but nucleus sampling over an empty set is undefined;
        # a client wanting greedy decoding sends temperature 0.
        "top_p": opt_number(body, "top_p", 0, 1, exclusive_minimum=True),
        "top_k": opt_int(body, "top_k", minimum=0),
        "min_p": opt_number(body, "min_p", 0, 1),
        "seed": opt_int(body, "seed", INT64_MIN, INT64_MAX),
        "repetition_penalty": opt_number(body, "repetition_penalty", 0,
                                         exclusive_minimum=True),
        "stop": parse_stop(body),
        "n": parse_n(body),
        "presence_penalty": opt_number(body, "presence_penalty", -2, 2),
        "frequency_penalty": opt_number(body, "frequency_penalty", -2, 2),
        "logit_bias": parse_logit_bias(body),
        "user": opt_str(body, "user"),
        "metadata": parse_metadata(body),
        "store": opt_bool(body, "store"),
        "service_tier": opt_str(body, "service_tier"),
        "prompt_cache_key": cache_key(body),
    }
