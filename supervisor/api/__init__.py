"""OpenAI-compatible HTTP surfaces: request validation (chat_request, completion_request,
params), response shapes (shapes), SSE framing (sse).

Pure functions and dataclasses, no I/O except sse's writers; the route handlers that glue
them to the worker pool live elsewhere. Kept import-free here: supervisor.errors imports
supervisor.api.sse, and the request parsers import supervisor.errors.
"""
