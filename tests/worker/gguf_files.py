"""GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them, from tiny
random-weight mlx-lm models, for the converter's round-trip tests.

The writer is llama.cpp's conventions spelled independently of worker/loading/gguf/: its tensor
names, its q/k row interleave for llama (`permute`, as in LlamaModel.permute), Gemma's
norms stored as 1 + w, the tokenizer as tokens + merges + token types. A conversion that
gives back the original model's logits has undone every one of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Hugging Face name under model.layers.N → llama.cpp's name under blk.N.
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
NORMS = {"llama": {"post_attention_layernorm": "ffn_norm"},
         "gemma2": {"pre_feedforward_layernorm": "ffn_norm",
                    "post_attention_layernorm": "post_attention_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Tiny shapes per family: (mlx-lm module, config, GGUF architecture).
BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=2048)
FAMILIES = {
    "llama": ("llama", dict(BASE, tie_word_embeddings=False), "llama"),
    "llama-tied": ("llama", dict(BASE, tie_word_embeddings=True), "llama"),
    "qwen2": ("qwen2", dict(BASE, tie_word_embeddings=False), "qwen2"),
    "qwen3": ("qwen3", dict(BASE, tie_word_embeddings=True), "qwen3"),
    "gemma": ("gemma", dict(BASE), "gemma"),
    "gemma2": ("gemma2", dict(BASE, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              query_pre_attn_scalar=16), "gemma2"),
    # mlx-lm's Gemma 3 needs a whole sliding-window pattern: 6 layers.
    "gemma3": ("gemma3_text", dict(BASE, num_hidden_layers=6, query_pre_attn_scalar=16,
                                   sliding_window=512, sliding_window_pattern=6,
                                   rope_local_base_freq=10000.0, rope_theta=1000000.0),
               "gemma3"),
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_model(family: str, vocab_size: int, seed: int = 0):
    """(mlx-lm model, config) with random weights, scaled so logits are far from flat."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    module, config, _ = FAMILIES[family]
    config = dict(config, model_type=module, vocab_size=vocab_size)
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = {k: (mx.random.normal(v.shape) * (0.02 if v.ndim > 1 else 0.1) + (v.ndim == 1))
              for k, v in tree_flatten(model.parameters())}
    if "model.embed_tokens.weight" in params:
        params["model.embed_tokens.weight"] = params["model.embed_tokens.weight"] * 50
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model, config


def gguf_name(hf: str, family: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{kind}"
    _, _, n, rest = stem.split(".", 3)
    norms = NORMS["gemma2" if family in ("gemma2", "gemma3") else "llama"]
    return f"blk.{n}.{BLOCK.get(rest) or norms[rest]}.{kind}"


def write(path: Path, family: str, model, config: dict, tokenizer_dir: Path, *,
          qtype: str = "F32", arch: str | None = None, pre: str = "default",
          extra_tensors: dict | None = None) -> Path:
    """Write `model` as llama.cpp would, with the byte-level BPE tokenizer of
    `tokenizer_dir` (tokenizer.json + its chat template)."""
    import gguf
    import gguf.quants
    from mlx.utils import tree_flatten

    arch = arch or FAMILIES[family][2]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {family}")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    _tokenizer(w, tokenizer_dir, pre)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf, value in tree_flatten(model.parameters()):
        values = np.array(value, dtype=np.float32)
        if family.startswith("llama") and hf.endswith("q_proj.weight"):
            values = permute(values, heads)
        if family.startswith("llama") and hf.endswith("k_proj.weight"):
            values = permute(values, kv_heads)
        if family.startswith("gemma") and hf.endswith("norm.weight"):
            values = values + 1.0
        name = gguf_name(hf, family)
        kind = getattr(gguf.GGMLQuantizationType, qtype if values.ndim > 1 else "F32")
        w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    for name, (values, kind) in (extra_tensors or {}).items():
        w.add_tensor(name, values, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tokenizer(w, tokenizer_dir: Path, pre: str) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").exists():
        template = (tokenizer_dir / "chat_template.jinja").read_text()
    w.add_chat_template(template)
