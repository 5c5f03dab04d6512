"""The API surfaces: one route module per surface (chat.py, completions.py, models.py,
health.py, responses/), each a parser (parse/) and a renderer (render/, or the Responses
builder) around the one request flow (generation.py) that talks to worker management.
"""
