"""Pooling models' surfaces: POST /v1/embeddings and POST /v1/rerank (routes.py, with
setup), their bodies → protocol Generates with a task (request.py), computed through the
one request lifecycle (api/lifecycle.py `compute`)."""
