"""POST /v1/completions (legacy text completions): its route (routes.py, with setup), its
body → a validated CompletionRequest (request.py), and its objects and stream chunks
(shapes.py), over the one request lifecycle (api/lifecycle.py)."""
