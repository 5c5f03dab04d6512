"""Vision-language models (mlx-vlm): chat with images.

`engine.py` prepares a request: the images decoded and processed by the model's own
processor on the preparation thread, the prompt's image tokens expanded, its cache key
made of the images' bytes; `language.py` makes the checkpoint's language model mlx-lm's
text class on mlx-vlm's weights; `batch.py` runs every request, text or with images, on
the text batch, an image prompt prefilled through mlx-vlm's step first; `serial.py`
runs them one at a time through mlx-vlm's generation step where mlx-lm has no text class
for the checkpoint.
"""
