"""What clients send besides text, decoded for any engine: audio (decode.py), which the
speech worker transcribes and a vision-language worker whose model hears audio reads."""
