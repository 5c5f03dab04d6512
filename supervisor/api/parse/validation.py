"""The request validators in one import: route handlers call these.

    parse_chat_request(body) -> ChatRequest            (chat_request.py)
    parse_completion_request(body) -> CompletionRequest (completion_request.py)

Both raise supervisor.http.errors.APIError (400, with `param`) for anything OpenAI's spec or
this server rejects; shared field rules live in params.py.
"""

from supervisor.api.parse.chat import ChatRequest, parse_chat_request
from supervisor.api.parse.completion import (
    DEFAULT_MAX_TOKENS, CompletionRequest, parse_completion_request,
)

__all__ = ["ChatRequest", "parse_chat_request", "CompletionRequest",
           "parse_completion_request", "DEFAULT_MAX_TOKENS"]
