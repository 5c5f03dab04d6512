"""Speech workers (mlx-audio): transcription (STT) and synthesis (TTS), one request at a
time (worker/loop/serial_scheduler.py); audio files are decoded on the preparation thread."""
