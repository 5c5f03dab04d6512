"""The audio API: /v1/audio/transcriptions and /translations (speech to text) and
/v1/audio/speech (text to speech), on speech workers (worker/speech/)."""

from aiohttp import web

from supervisor.api.audio import speech, transcriptions


def setup(app: web.Application) -> None:
    transcriptions.setup(app)
    speech.setup(app)
