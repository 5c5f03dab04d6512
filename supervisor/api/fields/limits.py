"""How much one request may ask for, beyond its byte size (--max-body-bytes) and nesting
(http/values.py): counts of the lists every layer below walks item by item.

A 16 MiB body can hold a million one-character messages or tools; each would then be
validated, templated and tokenized, and a tool's schema compiled into the grammar. The
bounds are far above what any real client sends (Claude Code: ~25 tools and a few
hundred messages in a long session; OpenAI caps tools at 128) and each refusal is a 400
naming the parameter and the limit, OpenAI's `array_above_max_length`.
"""

from __future__ import annotations

from supervisor.http.errors import APIError

MAX_MESSAGES = 10_000     # chat and Anthropic messages, Responses input items
# Content parts or blocks of all messages together, a tool result's own blocks included:
# one message may otherwise carry any number (an outside tester sent one Anthropic user
# message of 270,000 tool_result blocks; refusing it took 24 s).
MAX_PARTS = 10_000
MAX_TOOLS = 512
MAX_LOGIT_BIAS = 1024     # token ids biased
MAX_METADATA = 64         # keys (OpenAI allows 16; clients that send more lose nothing here)
# A stop string's length: the worker holds back up to this many characters of output and
# searches them at every token, so a megabyte stop string would slow every step.
MAX_STOP_CHARS = 1024
# Choices of one request (`n`, times the prompts of a legacy completion): each is a
# sequence of its own in the worker's batch (OpenAI's own bound for `n`).
MAX_CHOICES = 128
# A prompt_cache_key names a conversation's KV snapshot (kept in memory and in a file's
# header): an id, not a document.
MAX_CACHE_KEY_CHARS = 1024


def check_stop(param: str, text: str) -> None:
    check_chars(param, text, MAX_STOP_CHARS, "a stop sequence")


def check_cache_key(param: str, text) -> None:
    if text is not None:
        check_chars(param, text, MAX_CACHE_KEY_CHARS, "a prompt_cache_key")


def check_chars(param: str, text: str, limit: int, what: str) -> None:
    if len(text) > limit:
        raise APIError.bad_request(
            f"Invalid value for '{param}': {what} may be at most {limit} characters long, "
            f"got {len(text)}.", param, "string_above_max_length")


def check_length(param: str, value, limit: int) -> None:
    """Refuse a list (or mapping) longer than `limit`, naming both."""
    if len(value) > limit:  # worded as params.invalid_value words it (params imports this)
        raise APIError.bad_request(
            f"Invalid value for '{param}': array too long. Expected an array with maximum "
            f"length {limit}, but got an array with length {len(value)} instead.", param,
            "array_above_max_length")


def check_parts(param: str, messages: list) -> None:
    """Refuse messages holding more than MAX_PARTS content parts in all, counted before
    any of them is parsed. The parts of a list are looked into only once the list's own
    length is counted and within the limit, so the work is bounded by the limit, not by
    what was sent. `messages`: the request's list as sent (anything that is not an
    object is the parser's to refuse)."""
    n = 0
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            n += len(content)
            if n <= MAX_PARTS:
                n += sum(len(p["content"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("content"), list))
        if n > MAX_PARTS:
            raise APIError.bad_request(
                f"Invalid value for '{param}': the messages hold more than {MAX_PARTS} "
                "content parts in all.", param, "array_above_max_length")
