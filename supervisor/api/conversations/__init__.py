"""The Conversations API: /v1/conversations and its items (routes.py, request.py,
shapes.py), kept in the response store's file (store.py), and the `conversation` of
POST /v1/responses (turns.py): its items come before the input, and the response's items
are added when it ends."""
