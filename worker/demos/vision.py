"""A tiny random-weight vision-language model in real mlx-vlm format, built locally with
no download: the vision model of the tests, the benchmarks and `demo-vision`.

Qwen2-VL's architecture (mlx-vlm `qwen2_vl`: a ViT whose patches are merged 2×2 into
the language model's embeddings, multimodal rotary positions), at toy size and float32:
hidden 64, 2 language and 2 vision layers. Its processor is the family's own
(`Qwen2VLProcessor` with Qwen2-VL's image processor, configured in
preprocessor_config.json) over a byte-level BPE tokenizer trained in-process
(worker/demos/text.py) with the vision special tokens, and a chat template that puts
`<|vision_start|><|image_pad|><|vision_end|>` where a message has an image, which the
processor expands to one token per merged patch. Images are resized to between 56×56
and 112×112 pixels: 4 to 16 image tokens. `mlx_vlm.load` reads the directory like any
model from the hub.

`small` (the benchmark's, bench/multimodal.py) is larger where the engine should
dominate: hidden 512, 8 language layers, a 4-layer vision tower of width 256, images of
up to 448×448 pixels (256 image tokens). `2b` is Qwen2-VL-2B's language model for a GPU
(bench/vision_throughput.py, in bf16 there).

`family="qwen3.5"` builds Qwen3.5's architecture instead (mlx-vlm `qwen3_5`: a hybrid
language model, Gated DeltaNet linear-attention layers between full-attention ones,
whose recurrent state cannot be trimmed; Qwen3-VL's vision tower with 16-pixel patches
and learned position embeddings; interleaved multimodal rotary positions over part of
each head), with the same tokenizer and template and mlx-vlm's own Qwen3-VL processor:
the hybrid checkpoints the continuous batch serves beside the plain ones.

`family="gemma3"` builds Gemma 3's (mlx-vlm `gemma3`, mlx-lm `gemma3`/`gemma3_text`: a
SigLIP tower whose patches are average-pooled to a fixed count of image tokens, a
language model whose layers alternate a sliding window, a rotating cache, with global
attention, its head tied to its embeddings): 32×32-pixel images of 4 image tokens each, a window of 16
tokens so that a short prompt already wraps it, mlx-vlm's own Gemma3Processor over the
same tokenizer with Gemma's `<start_of_image>` markers.

`family="gemma4"` builds Gemma 4's (mlx-vlm `gemma4`, mlx-lm `gemma4`/`gemma4_text`): the
small variants' layout (E2B, E4B), sliding and global layers whose last half reads the
keys and values of earlier layers (no cache of their own), per-layer inputs beside the
embeddings, proportional rotary on the global layers, causal attention throughout, as
their configs leave `use_bidirectional_attention` unset; `family="gemma4-31b"` the large
ones' attention (26B-A4B, 31B: an image's tokens attended both ways, keys doubling as
values on the global layers, no shared KV, no per-layer inputs, no audio); a vision
tower of 4-pixel patches pooled 2×2 (at most 4 image tokens, images kept
aspect-preserving at most 16×16 pixels) and an audio tower (the conformer over 128 mel
bins, one audio token per 40 ms), with mlx-vlm's Gemma4Processor (its own
image processor and audio feature extractor) over the same tokenizer with Gemma 4's
`<|image|>` and `<|audio|>` placeholders.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from worker.demos.text import MARKER, BuiltModel, ChatTemplate, _train_tokenizer, save_model_dir

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

QWEN2_VL = ChatTemplate("qwen2-vl", (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"), VISION_TOKENS)

GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3 = ChatTemplate("chatml-gemma3", QWEN2_VL.text.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>"), GEMMA3_TOKENS)

MIN_PIXELS = 56 * 56
SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, mrope=[2, 3, 3],
                 mrope_half=[2, 1, 1], depth=2, embed=32, vision_heads=2, max_pixels=112 * 112),
    # `tiny` with heads of 32, which MLX can quantize (--kv-bits: its smallest group).
    "tiny-kvq": dict(hidden=64, layers=2, heads=2, kv_heads=1, mlp=128, mrope=[4, 6, 6],
                     mrope_half=[4, 2, 2], depth=2, embed=32, vision_heads=2,
                     max_pixels=112 * 112, head_dim=32),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=2, mlp=1536, mrope=[8, 12, 12],
                  mrope_half=[8, 4, 4], depth=4, embed=256, vision_heads=4, max_pixels=448 * 448),
    # Qwen2-VL-2B's language model (hidden 1536, 28 layers, MLP 8960: 1.3B parameters
    # besides the embeddings; the hybrid and Gemma 3 families get 56 layers of it, ~2.5B),
    # an 8-layer vision tower of Qwen2-VL's width, Gemma 3's 256 image tokens of a 448²
    # image; for a GPU in bf16 (bench/vision_throughput.py), where a 2,000-token prefill
    # costs enough that warm ÷ cold measures the cache rather than a request's fixed cost.
    "2b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, mlp=8960, mrope=[16, 24, 24],
               mrope_half=[11, 11, 10], depth=8, embed=1280, vision_heads=16,
               max_pixels=448 * 448, head_dim=128,
               gemma3=dict(image=448, patch=14, image_tokens=256, window=1024)),
}


def _qwen_processor(s: dict, processor: dict):
    """The processor files of Qwen's families: the image processor's config and the
    chat template."""
    def write(folder: Path) -> None:
        (folder / "preprocessor_config.json").write_text(json.dumps({
            **processor, "min_pixels": MIN_PIXELS, "max_pixels": s["max_pixels"],
            "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "do_convert_rgb": True}, indent=2))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL.text}))
    return write


def _scale_mergers(fc1, fc2) -> None:
    """The image's embeddings as large as the text's, so what it shows changes what the
    model says (a test checks that the image reaches the model)."""
    fc1.weight = fc1.weight * 4
    fc2.weight = fc2.weight * 16


def _qwen2_vl(s: dict, token, vocab_size: int, context_length: int):
    from mlx_vlm.models import qwen2_vl

    hidden = s["hidden"]
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": hidden, "num_hidden_layers": s["layers"], "intermediate_size": s["mlp"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
        "max_position_embeddings": context_length, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": s["mrope"]},
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": token("<|im_end|>"), "bos_token_id": token("<|endoftext|>"),
        "pad_token_id": token("<|endoftext|>"), "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "vision_start_token_id": token("<|vision_start|>"),
        "vision_end_token_id": token("<|vision_end|>"),
        "vision_config": {"model_type": "qwen2_vl", "depth": s["depth"],
                          "embed_dim": s["embed"], "hidden_size": hidden,
                          "num_heads": s["vision_heads"], "patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "in_channels": 3, "mlp_ratio": 2},
    }
    args = qwen2_vl.ModelConfig.from_dict(dict(config))
    args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    args.text_config = qwen2_vl.TextConfig.from_dict(config)
    model = qwen2_vl.Model(args)
    merger = model.vision_tower.merger.mlp  # [Linear, GELU, Linear]
    _scale_mergers(merger[0], merger[2])
    return config, model, _qwen_processor(s, {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "patch_size": 14})


def _qwen3_5(s: dict, token, vocab_size: int, context_length: int):
    from mlx_vlm.models import qwen3_5

    hidden, head = s["hidden"], s["hidden"] // s["heads"]
    ids = {"image_token_id": token("<|image_pad|>"), "video_token_id": token("<|video_pad|>"),
           "vision_start_token_id": token("<|vision_start|>"),
           "vision_end_token_id": token("<|vision_end|>")}
    config = {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "vocab_size": vocab_size, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": token("<|im_end|>"), **ids,
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": hidden, "intermediate_size": s["mlp"],
            "num_hidden_layers": 2 * s["layers"], "full_attention_interval": 2,
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": head, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
            "max_position_embeddings": context_length, "tie_word_embeddings": False,
            "eos_token_id": token("<|im_end|>"),
            "linear_num_value_heads": s["heads"], "linear_num_key_heads": s["kv_heads"],
            "linear_key_head_dim": head, "linear_value_head_dim": head,
            "linear_conv_kernel_dim": 4,
            # Rotary over half of each head, its frequencies split over (t, h, w).
            "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, "mrope_interleaved": True,
                                "mrope_section": s["mrope_half"]}},
        "vision_config": {"model_type": "qwen3_5", "depth": s["depth"],
                          "hidden_size": s["embed"], "intermediate_size": 2 * s["embed"],
                          "out_hidden_size": hidden, "num_heads": s["vision_heads"],
                          "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3,
                          "num_position_embeddings": 64, "deepstack_visual_indexes": []},
    }
    model = qwen3_5.Model(qwen3_5.ModelConfig.from_dict(dict(config)))
    merger = model.vision_tower.merger
    _scale_mergers(merger.linear_fc1, merger.linear_fc2)
    return config, model, _qwen_processor(s, {
        "image_processor_type": "Qwen3VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16})


GEMMA3_SIZES = {"tiny": dict(image=32, patch=8, image_tokens=4, window=16),
                "small": dict(image=224, patch=14, image_tokens=64, window=512)}


def _gemma3(s: dict, token, vocab_size: int, context_length: int):
    import mlx.core as mx
    from mlx_vlm.models import gemma3

    g = s.get("gemma3") or GEMMA3_SIZES["small" if s["hidden"] > 64 else "tiny"]
    hidden, head = s["hidden"], s.get("head_dim", 16)
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": vocab_size, "hidden_size": hidden, "torch_dtype": "float32",
        "image_token_index": token("<image_soft_token>"),
        "boi_token_index": token("<start_of_image>"), "eoi_token_index": token("<end_of_image>"),
        "mm_tokens_per_image": g["image_tokens"], "pad_token_id": token("<|endoftext|>"),
        "eos_token_id": [token("<|im_end|>")],
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": hidden, "intermediate_size": s["mlp"],
            "num_hidden_layers": 2 * s["layers"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": head,
            "query_pre_attn_scalar": head, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
            # Every other layer a sliding window (Gemma 3 has five in six).
            "sliding_window": g["window"], "sliding_window_pattern": 2,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "mm_tokens_per_image": g["image_tokens"],
            "max_position_embeddings": context_length},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": s["embed"],
                          "intermediate_size": 2 * s["embed"],
                          "num_hidden_layers": s["depth"],
                          "num_attention_heads": s["vision_heads"], "patch_size": g["patch"],
                          "image_size": g["image"], "layer_norm_eps": 1e-6,
                          "vision_use_head": False},
    }
    args = gemma3.ModelConfig.from_dict(dict(config))
    args.text_config = gemma3.TextConfig.from_dict(config["text_config"])
    args.vision_config = gemma3.VisionConfig.from_dict(config["vision_config"])
    model = gemma3.Model(args)
    # (mlx-vlm starts the projection at ones, which would give every image token one
    # constant embedding: random, at the text embeddings' size.)
    projector = model.multi_modal_projector
    projector.mm_input_projection_weight = 0.5 * mx.random.normal(
        projector.mm_input_projection_weight.shape)
    # Gemma ties its head to its embeddings (mlx-vlm ties it whatever the file says), so
    # a step's output is the input token's own row unless the layers outweigh the
    # embedding: their output norms scaled up (Gemma's norms scale by 1 + weight).
    for layer in model.language_model.model.layers:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight = mx.full(norm.weight.shape, 7.0)

    def write(folder: Path) -> None:
        (folder / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "size": {"height": g["image"], "width": g["image"]}, "resample": 2,
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
            "do_convert_rgb": True, "do_pan_and_scan": False}, indent=2))
        (folder / "processor_config.json").write_text(json.dumps({
            "processor_class": "Gemma3Processor", "image_seq_length": g["image_tokens"]}))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA3.text}))
    return config, model, write


GEMMA4_NAMED = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
GEMMA4 = ChatTemplate("chatml-gemma4", QWEN2_VL.text.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|image|>").replace(
    "{% elif part['type'] == 'text' %}",
    "{% elif part['type'] == 'audio' %}<|audio|>{% elif part['type'] == 'text' %}"),
    (*GEMMA4_NAMED.values(), "<|video|>"))  # (the processor adds the video token if absent)


# Gemma 4's sizes: `tiny` (tests) 4-pixel patches pooled 2×2 into at most 4 image tokens
# (16×16-pixel images), a 16-token window, 2.56 s clips; the larger ones Gemma 4's own
# 16-pixel patches pooled 3×3 (64 and 256 image tokens, its 512-token window, 30 s clips).
GEMMA4_SIZES = {
    "tiny": dict(patch=4, pool=2, positions=64, image_tokens=4, window=16, per_layer=8,
                 audio_tokens=64),
    "small": dict(patch=16, pool=3, positions=256, image_tokens=64, window=512, per_layer=64,
                  audio_tokens=750),
    "2b": dict(patch=16, pool=3, positions=1024, image_tokens=256, window=512, per_layer=256,
               audio_tokens=750)}


def _gemma4(s: dict, token, vocab_size: int, context_length: int, dense: bool = False):
    """Gemma 4's layout at toy size (mlx-vlm `gemma4`, mlx-lm `gemma4`/`gemma4_text`): its
    sliding and global layers (a 16-token window every other layer, the global ones with
    their own head size and proportional rotary over a quarter of each head) and a vision
    tower (GEMMA4_SIZES). As the small checkpoints (E2B, E4B): the last layers reading the
    keys and values of earlier ones (`num_kv_shared_layers`), per-layer inputs
    (`hidden_size_per_layer_input`), the audio tower (a conformer over the feature
    extractor's mel frames, one audio token per 40 ms) and causal attention throughout
    (`use_bidirectional_attention` unset). `dense`: as the large ones (26B-A4B's and 31B's
    attention, without the experts): an image's tokens attending each other both ways
    (`"vision"`), the global layers' keys doubling as values (`attention_k_eq_v`) over
    their own KV heads, no shared KV, no per-layer inputs, no audio."""
    import mlx.core as mx
    from mlx_vlm.models import gemma4

    hidden, head, layers = s["hidden"], s.get("head_dim", 16), 2 * s["layers"]
    g = GEMMA4_SIZES["tiny" if s["hidden"] <= 64 else "small" if s["hidden"] <= 512 else "2b"]
    image_tokens = g["image_tokens"]
    config = {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
        "vocab_size": vocab_size, "hidden_size": hidden, "torch_dtype": "float32",
        "image_token_id": token("<|image|>"), "boi_token_id": token("<|image>"),
        "eoi_token_id": token("<image|>"), "audio_token_id": token("<|audio|>"),
        "boa_token_id": token("<|audio>"), "eoa_token_id": token("<audio|>"),
        "video_token_id": token("<|video|>"),
        "vision_soft_tokens_per_image": image_tokens, "pad_token_id": token("<|endoftext|>"),
        "eos_token_id": [token("<|im_end|>")], "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": hidden, "intermediate_size": s["mlp"],
            "num_hidden_layers": layers, "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": head, "global_head_dim": 2 * head,
            "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
            "vocab_size_per_layer_input": vocab_size, "hidden_size_per_layer_input": g["per_layer"],
            "num_kv_shared_layers": 2 * (layers // 4), "use_double_wide_mlp": True,
            "sliding_window": g["window"], "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                                   "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                                      "rope_type": "default"}},
            "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
            "max_position_embeddings": context_length},
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": s["embed"],
                          "intermediate_size": 2 * s["embed"], "num_hidden_layers": s["depth"],
                          "num_attention_heads": s["vision_heads"],
                          "num_key_value_heads": s["vision_heads"],
                          "head_dim": s["embed"] // s["vision_heads"],
                          "global_head_dim": s["embed"] // s["vision_heads"],
                          "patch_size": g["patch"], "position_embedding_size": g["positions"],
                          "pooling_kernel_size": g["pool"], "default_output_length": image_tokens,
                          "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}},
        "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5,
                         "attention_chunk_size": 12, "attention_context_left": 13,
                         "attention_context_right": 0, "output_proj_dims": 32},
    }
    if dense:
        config["text_config"].update(
            use_bidirectional_attention="vision", attention_k_eq_v=True,
            num_global_key_value_heads=1, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
            use_double_wide_mlp=False)
        config["vision_config"]["standardize"] = True
        config["audio_config"] = None
    args = gemma4.ModelConfig.from_dict(dict(config))
    args.text_config = gemma4.TextConfig.from_dict(config["text_config"])
    args.vision_config = gemma4.VisionConfig.from_dict(config["vision_config"])
    args.audio_config = None if dense else gemma4.AudioConfig.from_dict(config["audio_config"])
    model = gemma4.Model(args)
    # (as Gemma 3's: a tied head, so the layers' output norms scaled up)
    for layer in model.language_model.model.layers:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight = mx.full(norm.weight.shape, 7.0)
    for embedder in (model.embed_vision, *([] if dense else [model.embed_audio])):
        embedder.embedding_projection.weight = embedder.embedding_projection.weight * 16

    def write(folder: Path) -> None:
        (folder / "processor_config.json").write_text(json.dumps({
            "processor_class": "Gemma4Processor", "audio_seq_length": g["audio_tokens"],
            "audio_ms_per_token": 40,
            "image_processor": {"patch_size": g["patch"], "max_soft_tokens": image_tokens,
                                "pooling_kernel_size": g["pool"], "do_resize": True,
                                "do_rescale": True, "do_normalize": False,
                                "rescale_factor": 1 / 255}}, indent=2))
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA4.text}))
    return config, model, write


# family → (its builder, its chat template, the tokenizer's named media tokens)
FAMILIES = {"qwen2-vl": (_qwen2_vl, QWEN2_VL, {}), "qwen3.5": (_qwen3_5, QWEN2_VL, {}),
            "gemma3": (_gemma3, GEMMA3, {"boi_token": "<start_of_image>",
                                         "eoi_token": "<end_of_image>",
                                         "image_token": "<image_soft_token>"}),
            "gemma4": (_gemma4, GEMMA4, GEMMA4_NAMED),
            "gemma4-31b": (functools.partial(_gemma4, dense=True), GEMMA4, GEMMA4_NAMED)}


def build_vision_model(path: str | Path, size: str = "tiny", *, family: str = "qwen2-vl",
                       seed: int = 0, context_length: int = 4096, dtype: str = "float32",
                       layers: int | None = None) -> BuiltModel:
    """Build the vision model of `size` and `family` at `path` (atomically; reused if
    already there), its weights in `dtype`; `layers`: the size's language layers but
    this many (a quick check of a large size's code path)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = Path(path)
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltModel(path, meta["context_length"], meta["vocab_size"])
    builder, template, named = FAMILIES[family]
    tokenizer = _train_tokenizer(1024, template)
    if named:  # (what Gemma's processor reads off its tokenizer)
        tokenizer._set_model_specific_special_tokens(special_tokens=named)
    vocab_size = len(tokenizer)  # every id the model can sample decodes
    token = tokenizer.convert_tokens_to_ids
    s = {**SIZES[size], **({"layers": layers} if layers else {})}
    mx.random.seed(seed)
    config, model, processor_files = builder(s, token, vocab_size, context_length)
    config["torch_dtype"] = dtype
    # As the text demo (worker/demos/text.py): a head scaled up, so greedy output has no
    # near-ties, and the EOS row zeroed, so generations run to max_tokens.
    lm = model.language_model
    tied = family.startswith("gemma")  # (its head is its embeddings: not saved)
    head = (lm.model.embed_tokens.weight if tied else lm.lm_head.weight) * 4
    head[token("<|im_end|>")] = 0.0
    lm.update({"model": {"embed_tokens": {"weight": head if tied
                                          else lm.model.embed_tokens.weight * 4}},
               **({"lm_head": {"weight": head}} if hasattr(lm, "lm_head") else {})})
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())
               if not (tied and k == "language_model.lm_head.weight")}
    mx.eval(weights)

    save_model_dir(path, weights, config, tokenizer,
                   {"preset": f"{size}-vision", "family": template.name, "seed": seed,
                    "architecture": family, "context_length": context_length,
                    "vocab_size": vocab_size, "dtype": dtype},
                   extra=processor_files)
    return BuiltModel(path, context_length, vocab_size)
