"""A tiny random-weight vision-language model in real mlx-vlm format, built locally with
no download: the vision model of the tests, the benchmarks and `demo-vision`.

Qwen2-VL's architecture (mlx-vlm `qwen2_vl`: a ViT whose patches are merged 2×2 into
the language model's embeddings, multimodal rotary positions), at toy size and float32:
hidden 64, 2 language and 2 vision layers. Its processor is the family's own
(`Qwen2VLProcessor` with Qwen2-VL's image processor, configured in
preprocessor_config.json) over a byte-level BPE tokenizer trained in-process
(worker/demo.py) with the vision special tokens, and a chat template that puts
`<|vision_start|><|image_pad|><|vision_end|>` where a message has an image, which the
processor expands to one token per merged patch. Images are resized to between 56×56
and 112×112 pixels: 4 to 16 image tokens. `mlx_vlm.load` reads the directory like any
model from the hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.demo import MARKER, BuiltModel, ChatTemplate, _train_tokenizer, save_model_dir

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

QWEN2_VL = ChatTemplate("qwen2-vl", (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"), VISION_TOKENS)

MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def build_vision_model(path: str | Path, *, seed: int = 0,
                       context_length: int = 4096) -> BuiltModel:
    """Build the tiny vision model at `path` (atomically; reused if already there)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    path = Path(path)
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltModel(path, meta["context_length"], meta["vocab_size"])
    tokenizer = _train_tokenizer(1024, QWEN2_VL)
    vocab_size = len(tokenizer)  # every id the model can sample decodes
    token = tokenizer.convert_tokens_to_ids
    hidden = 64
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": hidden, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "max_position_embeddings": context_length,
        "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": token("<|im_end|>"), "bos_token_id": token("<|endoftext|>"),
        "pad_token_id": token("<|endoftext|>"), "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "vision_start_token_id": token("<|vision_start|>"),
        "vision_end_token_id": token("<|vision_end|>"),
        "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32,
                          "hidden_size": hidden, "num_heads": 2, "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "in_channels": 3, "mlp_ratio": 2},
    }
    args = qwen2_vl.ModelConfig.from_dict(dict(config))
    args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    args.text_config = qwen2_vl.TextConfig.from_dict(config)
    mx.random.seed(seed)
    model = qwen2_vl.Model(args)
    # As the text demo (worker/demo.py): a head scaled up, so greedy output has no
    # near-ties, and the EOS row zeroed, so generations run to max_tokens.
    lm = model.language_model
    head = lm.lm_head.weight * 4
    head[config["eos_token_id"]] = 0.0
    lm.update({"model": {"embed_tokens": {"weight": lm.model.embed_tokens.weight * 4}},
               "lm_head": {"weight": head}})
    # And the image's embeddings as large as the text's, so what it shows changes what
    # the model says (a test checks that the image reaches the model).
    merger = model.vision_tower.merger.mlp  # [Linear, GELU, Linear]
    merger[0].weight = merger[0].weight * 4
    merger[2].weight = merger[2].weight * 16
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)

    def processor_files(folder: Path) -> None:
        (folder / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "do_convert_rgb": True}, indent=2))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL.text}))

    save_model_dir(path, weights, config, tokenizer,
                   {"preset": "tiny-vision", "family": QWEN2_VL.name, "seed": seed,
                    "context_length": context_length, "vocab_size": vocab_size},
                   extra=processor_files)
    return BuiltModel(path, context_length, vocab_size)
