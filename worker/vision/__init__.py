"""Vision-language models (mlx-vlm): chat with images.

`engine.py` prepares a request: the images decoded and processed by the model's own
processor on the preparation thread, the prompt's image tokens expanded; `serial.py`
runs the requests one at a time through mlx-vlm's generation step, with the same
per-sequence output as the text batch (stop strings, logprobs, grammars, tool calls).
"""
