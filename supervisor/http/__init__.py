"""The HTTP layer every surface shares: the error envelope and its middleware, request ids,
JSON bodies and the values they may hold, SSE framing, and /metrics."""
