"""The request validators in one import: route handlers call these.

    parse_chat_request(body) -> ChatRequest            (chat_request.py)
    parse_completion_request(body) -> CompletionRequest (completion_request.py)

Both raise supervisor.errors.APIError (400, with `param`) for anything OpenAI's spec or
this server rejects; shared field rules live in params.py.
"""

from supervisor.api.chat_request import ChatRequest, parse_chat_request
from supervisor.api.completion_request import (
    DEFAULT_MAX_TOKENS, CompletionRequest, parse_completion_request,
)

__all__ = ["ChatRequest", "parse_chat_request", "CompletionRequest",
           "parse_completion_request", "DEFAULT_MAX_TOKENS"]
