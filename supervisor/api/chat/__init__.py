"""POST /v1/chat/completions: its route (routes.py, with setup), its body → a validated
ChatRequest and its protocol Generate (request.py), and its completion objects and
stream chunks (shapes.py), over the one request lifecycle (api/lifecycle.py)."""
