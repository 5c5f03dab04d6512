"""`truncation: "auto"` on POST /v1/responses: an input past the model's window is cut at
the beginning of the conversation, as OpenAI's API does ("the model will truncate the
response to fit the context window by dropping items from the beginning of the
conversation"), where "disabled" (the default) refuses it with context_length_exceeded.
The OpenAI Agents SDK sends it (`ModelSettings(truncation="auto")`) for a long run that
should go on rather than fail.

The supervisor does not tokenize: the worker counts a prompt exactly as generation renders
it (the tokenize task, as context management counts one: summary.py). A count renders and
tokenizes the whole conversation, so it runs only where the input could be past the
window: the chat models' tokenizers are byte-complete (worker/text/token_bound.py), a
token at least one byte of text, so a conversation whose text, tools and instructions are
fewer bytes than the window holds tokens, less a margin for the template's own words, fits
uncounted (an image's tokens are not its bytes: a prompt with media is always counted).
Past that, whole turns go: the conversation's leading system and developer messages stay,
and the items from the first turn on up to a later user message go, the fewest turns that
fit (by bisection over the turns' starts); the turn in progress (from the latest user
message) always stays. If even that does not fit, the request goes as it was and the
worker's context_length_exceeded says so. A cut prompt is a new prefix: it resumes from no
snapshot (its end is kept under the response's id as usual).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from protocol.messages import Generate, Task
from supervisor.api import lifecycle

# Bytes a chat template may add to a conversation's own (its role markers, a default system
# prompt, a tool-calling preamble): an input within the window less this is not counted.
TEMPLATE_MARGIN = 4096
CONVERSATION_ROLES = ("system", "developer")  # leading messages of these roles stay


def turn_starts(items: list[dict]) -> tuple[int, list[int]]:
    """(how many leading system/developer messages stay, the indices the kept part may
    start at: each later user message's, up to and including the latest's)."""
    lead = 0
    while lead < len(items) and items[lead].get("type") == "message" \
            and items[lead].get("role") in CONVERSATION_ROLES:
        lead += 1
    starts = [i for i in range(lead + 1, len(items))
              if items[i].get("type") == "message" and items[i].get("role") == "user"]
    return lead, starts


def room(window: int, max_tokens: int | None) -> int:
    """The most prompt tokens the worker takes (worker/text/engine.py `_check_context`):
    the window less the completion's tokens (the request's `max_output_tokens`, else the
    server's default), or less one token for it where there are none."""
    return window - (max_tokens if max_tokens is not None else 1)


def surely_fits(message: Generate, limit: int) -> bool:
    if message.images or message.audios:
        return False
    size = len(msgspec.json.encode(message.messages)) + len(msgspec.json.encode(message.output))
    return size + TEMPLATE_MARGIN <= limit


async def fit(request: web.Request, runner, req, items: list[dict], message: Generate,
              make, count: int | None = None) -> Generate:
    """`message` (built from `items` by `make(items)`), or, with truncation "auto" and a
    prompt past the window, one built from the conversation's last turns that fits.
    `count`: `message`'s tokens where the caller counted them already (context
    management's threshold: summary.py)."""
    window = runner.context_length
    if req.truncation != "auto" or not window:
        return message
    sampling = message.sampling
    limit = room(window, None if sampling.max_tokens_ceiling else sampling.max_tokens)
    if count is None and surely_fits(message, limit):
        return message

    async def tokens(m: Generate) -> int:
        counted = await lifecycle.compute(request, req.model,
                                          msgspec.structs.replace(m, task=Task.TOKENIZE))
        return len(counted.result.id_list())

    if (count if count is not None else await tokens(message)) <= limit:
        return message
    lead, starts = turn_starts(items)

    def cut(start: int) -> Generate:
        m = make(items[:lead] + items[start:])
        return msgspec.structs.replace(m, cache=msgspec.structs.replace(
            m.cache, resume_from=None, resume_label=""))

    if not starts or await tokens(last := cut(starts[-1])) > limit:
        return message  # (even the turn in progress alone does not fit: the worker says so)
    lo, hi, best = 0, len(starts) - 1, last  # starts[hi] fits; find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = cut(starts[mid])
        if await tokens(candidate) <= limit:
            hi, best = mid, candidate
        else:
            lo = mid + 1
    return best
