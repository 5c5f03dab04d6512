"""The API surfaces, one folder per surface, each holding its routes (routes.py, with a
`setup(app)` that supervisor/app.py calls), its request parsing (request.py) and its
response shapes: chat/, completions/, pooling/ (embeddings, rerank), messages/
(Anthropic), responses/, audio/; and the small ones as modules with a setup():
tokenize.py, models.py (GET /v1/models) and health.py.

What they share lives once: the field rules every body is parsed with (fields/), the one
request lifecycle that talks to worker management (lifecycle.py: submit, run, stream,
compute) and the worker's output independent of any API's shape (output.py).
"""
