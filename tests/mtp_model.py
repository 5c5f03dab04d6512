"""A tiny random-weight Qwen3.5-style checkpoint WITH its multi-token-prediction head,
written as the Hugging Face checkpoints are (so that loading it exercises the same path
a real one takes: worker/speculative/mtp.py):

- config.json: `model_type` qwen3_5 with a `text_config` holding `mtp_num_hidden_layers`,
  `full_attention_interval`, `layer_types` and `rope_parameters`, as Qwen3.5's;
- weights: `model.language_model.*` and `lm_head.weight` for the model, `mtp.fc`,
  `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` and
  `mtp.norm` for the head; RMSNorm weights zero-centred (stored as weight - 1) and the
  GatedDeltaNet convolutions as (channels, 1, kernel), the layout mlx-lm's and mlx-vlm's
  sanitize convert from.

float32, the demo tokenizer (worker/demos/text.py); three GatedDeltaNet (recurrent)
layers and one attention layer, as Qwen3.5's `full_attention_interval` of 4 has.
"""

from __future__ import annotations

from pathlib import Path

TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
# bench/speculative.py's `--mtp small`: the engine's work, not Python's, dominates a step
# (hidden 512, 8 layers, ~18M parameters in the layers, the head's layer ~3M), and the
# LM head is the largest matrix, as a real Qwen3.5's is (2B: 0.5B of its parameters): a
# vocabulary of 32768, the rows past the tokenizer's zero (greedy text never picks them).
SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, intermediate_size=1536,
             linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64, vocab_size=32768)
_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight",
            ".q_norm.weight", ".k_norm.weight", "pre_fc_norm_embedding.weight",
            "pre_fc_norm_hidden.weight")


def build_mtp_model(path: Path, *, full_attention_interval: int = 4, seed: int = 0,
                    context_length: int = 4096, mtp: bool = True,
                    predictable: bool = False, sizes: dict | None = None) -> Path:
    """Build (once) the checkpoint at `path`; `mtp=False`: the same without its head;
    `sizes`: TEXT's sizes replaced (SMALL).

    `predictable`: a head that guesses well, so that drafts are accepted (a random head
    almost never is). The model's layers write back a twentieth of the usual (each next
    token is then mostly a function of the token before: the final norm of its
    embedding through the LM head), and the head passes its input token's embedding
    straight through (`fc` keeps the embedding half; its attention and MLP write
    nothing): it predicts the token after next as that function of the next token.
    The layers still shift some tokens, so some drafts are rejected too."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    from worker.demos.text import CHATML, MARKER, _train_tokenizer, save_model_dir
    from worker.speculative.mtp import MTPHead

    path = Path(path)
    if (path / MARKER).exists():
        return path
    tokenizer = _train_tokenizer(1024, CHATML)
    sizes = dict(TEXT, **(sizes or {}))
    vocab = sizes.pop("vocab_size", None) or max(1024, len(tokenizer))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    layers = sizes["num_hidden_layers"]
    text = dict(sizes, model_type="qwen3_5_text", vocab_size=vocab, eos_token_id=eos,
                full_attention_interval=full_attention_interval,
                layer_types=["full_attention" if (i + 1) % full_attention_interval == 0
                             else "linear_attention" for i in range(layers)],
                max_position_embeddings=context_length, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    if not mtp:
        text.pop("mtp_num_hidden_layers")
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": False, "torch_dtype": "float32",
              "eos_token_id": eos}
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    lm = model.language_model
    # As the demo models (worker/demos/text.py): a sharp head with no EOS, so greedy text
    # varies and runs to max_tokens.
    head = lm.lm_head.weight * 4
    head[eos] = 0.0
    if vocab > max(1024, len(tokenizer)):
        head[len(tokenizer):] = 0.0
    lm.update({"model": {"embed_tokens": {"weight": lm.model.embed_tokens.weight * 4}},
               "lm_head": {"weight": head}})
    if predictable:
        for layer in lm.model.layers:
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            out = mixer.out_proj if layer.is_linear else mixer.o_proj
            out.weight = out.weight * 0.05
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.05
    weights = {}
    for key, value in tree_flatten(model.parameters()):
        key = key.replace("language_model.model.", "model.language_model.") \
                 .replace("language_model.lm_head.", "lm_head.")
        weights[key] = value
    if mtp:
        head = MTPHead(lm.args, 1)
        if predictable:
            size = lm.args.hidden_size
            head.fc.weight = mx.concatenate([mx.eye(size), mx.zeros((size, size))], axis=1)
            head.layers[0].self_attn.o_proj.weight *= 0
            head.layers[0].mlp.down_proj.weight *= 0
        for key, value in tree_flatten(head.parameters()):
            weights["mtp." + key] = value
    # (mlx-lm shifts the model's norms only where it sees unconverted convolutions: a
    # model without recurrent layers keeps them as they are; the head's always are.)
    hybrid = full_attention_interval > 1
    for key, value in list(weights.items()):
        if "conv1d.weight" in key:
            weights[key] = value.moveaxis(1, 2)          # (C, K, 1) -> (C, 1, K)
        elif key.endswith(_CENTRED) and value.ndim == 1 and "linear_attn" not in key \
                and (hybrid or key.startswith("mtp.")):
            weights[key] = value - 1.0
    mx.eval(weights)
    save_model_dir(path, weights, config, tokenizer,
                   {"preset": "qwen3_5-mtp", "seed": seed, "sizes": sizes,
                    "context_length": context_length, "vocab_size": vocab},
                   weights_format="pt")
    return path
