"""The tiny vision model (worker/demos/vision.py) is a real mlx-vlm model: mlx-vlm loads
it with its family's processor, an image becomes image tokens in the prompt, and it
streams tokens (random weights: the words mean nothing; the structure is what counts)."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image


def image(w, h, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def test_mlx_vlm_loads_it_and_an_image_becomes_tokens_of_its_size(vision_model):
    from mlx_vlm import load, stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(vision_model))
    assert type(processor).__name__ == "Qwen2VLProcessor"
    config = json.loads((vision_model / "config.json").read_text())
    prompt = apply_chat_template(processor, model.config, "What is this?", num_images=1)
    assert prompt.count("<|image_pad|>") == 1

    def run(img):
        out = list(stream_generate(model, processor, prompt, image=[img], max_tokens=6,
                                   temperature=0.0))
        n = out[-1].generation_tokens  # (the last response may only flush the text)
        return out[-1].prompt_tokens, [r.token for r in out][:n]

    small, big = run(image(40, 40)), run(image(300, 200))
    text_only = len(processor.tokenizer.encode(prompt))
    # 56×56 at least: 2×2 merged patches of 14 px = 4 tokens; 112×112 at most: 16.
    assert small[0] == text_only - 1 + 4 and text_only - 1 + 4 < big[0] <= text_only - 1 + 16
    assert len(small[1]) == 6 and all(0 <= t < config["vocab_size"] for t in small[1])
    assert run(image(40, 40))[1] == small[1]  # greedy: the same image, the same tokens
    assert run(image(40, 40, seed=1))[1] != small[1]  # the image reaches the model
