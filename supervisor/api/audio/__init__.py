"""The audio API: /v1/audio/transcriptions and /translations (speech to text) and
/v1/audio/speech (text to speech), on speech workers (worker/speech/)."""
