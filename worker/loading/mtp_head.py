"""The MTP head's weights, read from a Qwen3.5/3.6 checkpoint by their `mtp.` names
(worker/speculative/mtp.py runs the head). mlx-lm drops these weights when it loads the
model, and MLX conversions usually drop them from the files, so they are read from the
original checkpoint's safetensors (only the files its index names for them, lazily), the
Hugging Face layout's zero-centred norms shifted as mlx-vlm's sanitize does.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from worker.errors import LoadError
from worker.speculative.mtp import MTPHead, text_model

# Norms the Hugging Face layout stores zero-centred (weight - 1): mlx-vlm's rule.
_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
            ".q_norm.weight", ".k_norm.weight", "norm.weight",
            "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def load_head(model, path) -> MTPHead:
    """The MTP head of the checkpoint at `path` for `model` (loaded by mlx-lm), in the
    model's dtype; a LoadError naming what is missing where it has none."""
    lm = text_model(model)
    args = getattr(lm, "args", None)
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config", config)
    layers = int(text.get("mtp_num_hidden_layers", 0) or 0)
    if type(lm).__module__ != "mlx_lm.models.qwen3_5" or args is None:
        raise LoadError("--speculative mtp: this model's family has no MTP head mlxd "
                        f"can run (Qwen3.5/3.6-style checkpoints have one; this is "
                        f"{config.get('model_type')!r})")
    if getattr(args, "num_experts", 0):
        raise LoadError("--speculative mtp: MoE MTP heads are not supported yet")
    weights = {}
    for f in _shards(Path(path)):
        for key, value in mx.load(str(f)).items():  # (lazy: only the head's are read)
            if "mtp." in key:
                weights[key] = value
    if not layers or not weights:
        raise LoadError("--speculative mtp: the checkpoint has no MTP weights (no "
                        "`mtp.*` tensors or no mtp_num_hidden_layers in its config; "
                        "MLX conversions usually drop them: use the original checkpoint)")
    head = MTPHead(args, layers)
    mine = {}
    for key, value in weights.items():
        top = key.startswith("mtp.")  # the Hugging Face layout: zero-centred norms
        key = key[key.index("mtp.") + 4:]
        if top and key.endswith(_CENTRED) and value.ndim == 1:
            value = value + 1.0
        mine[key] = value
    quant = config.get("quantization")
    if quant and any(k.endswith(".scales") for k in mine):
        nn.quantize(head, quant["group_size"], quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in mine)
    try:
        head.load_weights(list(mine.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"--speculative mtp: the checkpoint's MTP weights do not fit "
                        f"its config: {e}"[:500]) from None
    dtype = lm.model.embed_tokens.weight.dtype
    if not quant:
        head.set_dtype(dtype)
    head.eval()
    mx.eval(head.parameters())
    return head


def _shards(path: Path) -> list:
    """The checkpoint's safetensors files that hold `mtp.` weights (by its index, where
    it has one)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text()).get("weight_map", {})
        return sorted({path / f for k, f in names.items() if "mtp." in k})
    return sorted(Path(f) for f in glob.glob(str(path / "*.safetensors")))
