"""Images (and other media) a client sends to a model that reads text only.

Every surface (chat completions' `image_url` and `input_audio` parts, Responses'
`input_image`, `input_file` and `input_audio`, Messages' `image` and `document` blocks)
follows one rule, so a client can switch models in the middle of a conversation:
- media in the conversation's LAST user turn is what the client asks about now: a 400
  naming the part, saying the model cannot see it (answering as if it had seen it would be
  worse);
- media earlier in the history becomes a short placeholder in the text, so the rest of
  the conversation still reaches the model.
Each part is still checked for its shape, wherever it is.
"""

from __future__ import annotations

from supervisor.http.errors import APIError

IMAGE_PLACEHOLDER = "[image]"
_PLACEHOLDERS = {"audio": "[audio]", "file": "[file]", "document": "[document]"}

NOUNS = {"image_url": "image", "input_image": "image", "image": "image",
         "input_audio": "audio", "input_file": "file", "file": "file", "document": "document"}


def placeholder(kind: str) -> str:
    """The text that stands for a media part of type `kind` in the history."""
    return _PLACEHOLDERS.get(NOUNS.get(kind, "image"), IMAGE_PLACEHOLDER)


def media_part(at: str, kind: str, in_last_user_turn: bool) -> str:
    """A media part of a text model's request: its placeholder, or the 400 when it is in
    the turn being answered."""
    if in_last_user_turn:
        noun = NOUNS.get(kind, "image")
        raise APIError.bad_request(
            f"{at}: this model cannot read {noun}s; mlxd serves text models only so far. "
            f"Send text, or leave the {noun} out.", f"{at}.type", "unsupported_value")
    return placeholder(kind)


def last_user_index(messages: list) -> int:
    """The index of the last user message (-1: none); Responses items of other types
    (function calls and their outputs) are not messages."""
    return max((i for i, m in enumerate(messages) if isinstance(m, dict)
                and m.get("role") == "user" and m.get("type", "message") == "message"),
               default=-1)
