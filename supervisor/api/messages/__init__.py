"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), what
Claude-style coding agents speak: its request shape converted to the one protocol
Generate (request.py), its message and content blocks (shapes.py), its named event stream
(stream.py) and its error envelope (errors.py), over the same request lifecycle as every
other surface."""
