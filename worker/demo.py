"""Tiny random-weight models in real mlx-lm format, built locally with no download.

`demo` (what `make serve` runs), the test fixtures and the benchmarks all build their
models here: a qwen2-type config, float32 random weights (MLX's CPU backend runs float32
far faster than half precision or 4-bit), a byte-level BPE tokenizer trained in-process
with `tokenizers`, and a ChatML chat template. The output is an ordinary model directory
that `mlx_lm.load` reads like any model from the Hugging Face hub.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The architectures of the presets. `demo` and `tiny` are the same size: so small that
# the server's own overhead dominates. `small` (~28M parameters) makes the engine dominate.
PRESETS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1024),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=1536, vocab_size=8000),
}
PRESETS["demo"] = PRESETS["tiny"]

MARKER = "mlxd-random-weights.json"  # written into the model dir: these are not real weights

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Training text for the tokenizer: varied enough that merges cover common English and JSON.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "system user assistant tool function call arguments name content role",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def main():\n    print('hello')\n    return 0\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 -42 true false null",
    "Local language models run on Apple Silicon with MLX and a small server.",
    "Once upon a time there was a little model that wanted to talk.",
    "Write a haiku about the sea. Count to ten. Tell me a story about a robot.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]


@dataclass(frozen=True)
class BuiltModel:
    path: Path
    context_length: int
    vocab_size: int


def is_random_weights(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists()


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(path: str | Path, preset: str = "tiny", *, seed: int = 0,
                context_length: int = 4096) -> BuiltModel:
    """Build a random-weight model at `path` (atomically; reused if already there)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    path = Path(path)
    arch = PRESETS[preset]
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltModel(path, meta["context_length"], meta["vocab_size"])

    tokenizer = _train_tokenizer(arch["vocab_size"])
    vocab_size = max(arch["vocab_size"], len(tokenizer))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **arch,
        "vocab_size": vocab_size,
        "max_position_embeddings": context_length,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    # Untied head, scaled up: the logits are far from uniform (argmax has no near-ties, so
    # greedy output is stable) and greedy text varies instead of repeating one token.
    # The EOS row of the head is zeroed: its logit is always 0 while the largest logit is
    # far above, so generations run to max_tokens (tests and benchmarks need known lengths).
    head = model.lm_head.weight * 4
    head[eos_id] = 0.0
    model.update({"model": {"embed_tokens": {"weight": model.model.embed_tokens.weight * 4}},
                  "lm_head": {"weight": head}})
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        meta = {"preset": preset, "seed": seed, "context_length": context_length,
                "vocab_size": vocab_size, "note": "random weights: output is meaningless"}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first
            if not (path / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BuiltModel(path, context_length, vocab_size)
