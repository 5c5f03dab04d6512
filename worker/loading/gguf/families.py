"""The model families a GGUF can be converted from: the mlx-lm config each one's metadata
means, and how llama.cpp's tensor names and layouts map back to the Hugging Face ones
mlx-lm reads.

What llama.cpp's converter (convert_hf_to_gguf.py) changed, and is undone here:
- names: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight`, and so on;
- llama (and everything llama.cpp files as llama: Mistral, SmolLM): the rows of q and k
  are interleaved per head for llama.cpp's rope (`permute`); mlx-lm's rope wants them
  back in halves;
- Gemma: RMSNorm weights are stored as 1 + w (llama.cpp's norm multiplies by the weight;
  Gemma's multiplies by 1 + w, as mlx-lm's Gemma models do);
- Llama 3.1/3.2: the "llama3" rope scaling is stored as a table of per-frequency factors
  (`rope_freqs`); the parameters that made it are recovered and checked against it.

Anything else in a file (a tensor with no known name, an architecture not listed here) is
a `GGUFError` naming it: a silently dropped weight would load and answer nonsense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from worker.loading.gguf.reader import GGUFError, GGUFFile

# Per-block tensors: llama.cpp's name → the Hugging Face name under model.layers.N.
BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2 and 3 norm both sides of attention and of the MLP.
SANDWICH = {
    **BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = {"rope_freqs.weight"}  # read into the config (llama3 rope), not a weight


def f32(value) -> float:
    """A float32 from the file as the decimal it was written as (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str                       # config.json "architectures"
    block: dict = field(default_factory=lambda: BLOCK)
    permute_qk: bool = False                # llama.cpp interleaved q/k rows (llama only)
    norm_offset: float = 0.0                # Gemma: the file holds 1 + w
    extra: Callable[[GGUFFile, dict], dict] = lambda g, c: {}

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None if it is not one we know."""
        stem, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        if stem in TOP:
            return f"{TOP[stem]}.{kind}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.block:
            return f"model.layers.{parts[1]}.{self.block[parts[2]]}.{kind}"
        return None

    def transform(self, name: str, values: np.ndarray, config: dict) -> np.ndarray:
        """Undo llama.cpp's changes to one tensor (by its GGUF name)."""
        if self.permute_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute(values, config["num_attention_heads"])
        if self.permute_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute(values, config["num_key_value_heads"])
        if self.norm_offset and name.endswith("norm.weight"):
            return values - self.norm_offset
        return values


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's `permute`: per head, rows (0, 2, 4, ..., 1, 3, 5, ...)
    back to their Hugging Face order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def base_config(g: GGUFFile, fam: Family, vocab_size: int) -> dict:
    hidden = int(g.require("embedding_length"))
    heads = _uniform(g, "attention.head_count")
    kv_heads = _uniform(g, "attention.head_count_kv", heads)
    config = {
        "model_type": fam.model_type,
        "architectures": [fam.architecture],
        "hidden_size": hidden,
        "num_hidden_layers": int(g.require("block_count")),
        "intermediate_size": int(g.require("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(g.arch_get("attention.key_length") or hidden // heads),
        "rms_norm_eps": f32(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": f32(g.arch_get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.arch_get("context_length", 4096)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    scaling = g.arch_get("rope.scaling.type")
    factor = g.arch_get("rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and float(factor) != 1.0:
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": f32(factor)}
        original = g.arch_get("rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{g.path.name}: rope scaling {scaling!r} is not supported")
    return config


def _uniform(g: GGUFFile, key: str, default=None) -> int:
    value = g.arch_get(key, default)
    if isinstance(value, list):  # per-layer counts (some hybrids): not one of ours
        if len(set(value)) != 1:
            raise GGUFError(f"{g.path.name}: {g.arch}.{key} varies by layer; not supported")
        value = value[0]
    if value is None:
        raise GGUFError(f"{g.path.name} lacks the metadata {g.arch}.{key}")
    return int(value)


# ---- per family ------------------------------------------------------------------------

def _llama(g: GGUFFile, config: dict) -> dict:
    extra = {"attention_bias": "blk.0.attn_q.bias" in g.tensors,
             "mlp_bias": "blk.0.ffn_up.bias" in g.tensors}
    if "rope_freqs.weight" in g.tensors:
        extra["rope_scaling"] = llama3_rope(g.tensor("rope_freqs.weight"), config)
    return extra


def llama3_rope(factors: np.ndarray, config: dict) -> dict:
    """The "llama3" rope scaling whose per-frequency factors llama.cpp stored: the factor
    is the largest of them; the other parameters are Llama 3's (as llama.cpp assumes
    when missing), checked by recomputing the table."""
    scaling = {"rope_type": "llama3", "factor": float(np.max(factors)), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    dim = config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    expected = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            expected.append(1.0)
        elif wavelen > low:
            expected.append(scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - 1.0) / 3.0
            expected.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    if len(expected) != factors.size or not np.allclose(expected, factors, rtol=1e-3):
        raise GGUFError("the file's rope_freqs are not Llama 3's rope scaling; not supported")
    return scaling


def _gemma2(g: GGUFFile, config: dict) -> dict:
    # The file does not store query_pre_attn_scalar; llama.cpp derives it the same way:
    # the 27B model (46 layers) scales by hidden/heads, the others by the head size.
    big = config["num_hidden_layers"] == 46
    return {"attn_logit_softcapping": f32(g.arch_get("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": f32(g.arch_get("final_logit_softcapping", 30.0)),
            "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                      if big else config["head_dim"])}


def _gemma3(g: GGUFFile, config: dict) -> dict:
    # As llama.cpp: every 6th layer global, the others local (base 10000); the 27B model
    # (62 layers) scales queries by hidden/heads.
    big = config["num_hidden_layers"] == 62
    return {"sliding_window": int(g.arch_get("attention.sliding_window", 512)),
            "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                      if big else config["head_dim"])}


FAMILIES: dict[str, Family] = {
    # llama.cpp files Mistral 7B, SmolLM and other llama-shaped models as "llama".
    "llama": Family("llama", "LlamaForCausalLM", permute_qk=True, extra=_llama),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM"),
    "gemma": Family("gemma", "GemmaForCausalLM", norm_offset=1.0),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM", block=SANDWICH, norm_offset=1.0,
                     extra=_gemma2),
    "gemma3": Family("gemma3_text", "Gemma3ForCausalLM", block=SANDWICH, norm_offset=1.0,
                     extra=_gemma3),
}


def family(g: GGUFFile) -> Family:
    fam = FAMILIES.get(g.arch)
    if fam is None:
        raise GGUFError(f"{g.path.name}: architecture {g.arch!r} cannot be converted "
                        f"(supported: {', '.join(sorted(FAMILIES))})")
    return fam


def config_for(g: GGUFFile, vocab_size: int) -> dict:
    fam = family(g)
    config = base_config(g, fam, vocab_size)
    config.update(fam.extra(g, config))
    return config
