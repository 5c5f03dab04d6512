"""OpenAI's built-in voice names on every speech model.

Apps written for OpenAI send `voice: "alloy"` (or another of its built-in names, the
specification's `VoiceIdsShared` and CreateSpeechRequest list) whatever model they name;
a local model has voices of its own (Kokoro's `af_heart`, Pocket TTS's, a folder of voice
packs). So each built-in name stands for one of the model's voices: the model's own voice
of that name first (the name always means what the model says), then one whose name holds
it as a word (Kokoro's `af_alloy`, `am_echo`), then the model's voices in turn, in the order
the model lists them. The mapping depends only on that list, so it is stable across
restarts, and /v1/models shows it (`voice_aliases`). A name that is neither the model's
nor OpenAI's still reaches the worker, whose 400 lists the voices.
"""

from __future__ import annotations

import re

# CreateSpeechRequest's built-in voices, in the specification's order.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                 "shimmer", "verse", "marin", "cedar")


def aliases(voices: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Each OpenAI voice name that is not one of `voices` → the voice it stands for."""
    if not voices:
        return {}
    out: dict[str, str] = {}
    turn = 0
    for name in OPENAI_VOICES:
        if name in voices:
            continue
        word = re.compile(rf"(^|[^a-z]){name}($|[^a-z])", re.IGNORECASE)
        match = next((v for v in voices if word.search(v)), None)
        if match is None:
            match, turn = voices[turn % len(voices)], turn + 1
        out[name] = match
    return out


def resolve(voice: str | None, voices: list[str] | tuple[str, ...]) -> str | None:
    """The voice to ask the model for: its own name as given, an OpenAI name mapped."""
    if voice is None or voice in voices:
        return voice
    return aliases(voices).get(voice, voice)


def is_alias(voice: str | None) -> bool:
    return voice in OPENAI_VOICES
