"""Tiny random-weight models in real mlx-lm format, built locally with no download.

`demo` (what `make serve` runs), the test fixtures and the benchmarks all build their
models here: a qwen2-type config, float32 random weights (MLX's CPU backend runs float32
far faster than half precision or 4-bit), a byte-level BPE tokenizer trained in-process
with `tokenizers`, and a ChatML chat template. The output is an ordinary model directory
that `mlx_lm.load` reads like any model from the Hugging Face hub.

Templates: plain ChatML (the demo model, the benchmark presets) and QWEN, a tool-calling
ChatML that the constrained-decoding benchmark needs. The other tool-calling families
only tests use, so they live with the tests (tests/families.py), built with
`tool_template` from here.
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
    # Worker groups (worker/group/): 6 heads, 6 layers and MLP columns that split over 2
    # and 3 ranks, by tensor and by pipeline parallelism alike.
    "tiny-shard": dict(hidden_size=96, num_hidden_layers=6, num_attention_heads=6,
                       num_key_value_heads=6, intermediate_size=192, vocab_size=1024),
}
PRESETS["demo"] = PRESETS["tiny"]
# A quantized KV cache needs a head dimension of 32 at least (MLX's smallest quantization
# group): `tiny` with 2 heads of 32 (worker/kvcache/quantized.py's tests).
PRESETS["tiny-kvq"] = dict(PRESETS["tiny"], num_attention_heads=2)
# Hybrid architectures: recurrent layers (GatedDeltaNet, whose state cannot be trimmed
# back to a shorter prefix) between attention layers, as in Qwen3-Next / Qwen3.5. Dense
# (no experts), so the tiny ones cost what `tiny` and `small` cost. The prompt cache and
# the batch must serve them from snapshots (worker/kvcache/prefix.py).
_HYBRID = dict(model_type="qwen3_next", num_experts=0, num_experts_per_tok=1,
               decoder_sparse_step=1, full_attention_interval=2, partial_rotary_factor=0.5,
               linear_conv_kernel_dim=4)
PRESETS["tiny-hybrid"] = dict(
    _HYBRID, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=1024, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    shared_expert_intermediate_size=128, moe_intermediate_size=64)
PRESETS["tiny-hybrid-kvq"] = dict(PRESETS["tiny-hybrid"], head_dim=32)
PRESETS["small-hybrid"] = dict(
    _HYBRID, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, intermediate_size=1536, vocab_size=8000, linear_num_value_heads=8,
    linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    shared_expert_intermediate_size=1536, moe_intermediate_size=512)

# Sliding-window attention between global layers, as in Gemma 3 (mlx-lm `gemma3_text`):
# a 16-token window every other layer (its rotating cache cannot be trimmed or
# quantized), heads of 32 for a quantized KV cache on the global ones.
PRESETS["tiny-sliding-kvq"] = dict(
    model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, intermediate_size=128,
    vocab_size=1024, sliding_window=16, sliding_window_pattern=2)
# The same with a 64-token window: prompts that fit in it, and decoding that wraps it.
PRESETS["tiny-sliding-64"] = dict(PRESETS["tiny-sliding-kvq"], sliding_window=64)

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}
MARKER = "mlxd-random-weights.json"  # written into the model dir: these are not real weights


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it adds to the tokenizer. `name` is recorded
    in the model's marker file, so a built model says which template it carries."""
    name: str
    text: str
    special_tokens: tuple[str, ...] = ()


CHATML = ChatTemplate("chatml", (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with tools, history and thinking, compact but rendering a real tool-calling
# family's format exactly, so mlx-lm infers the same tool parser and thinking markers as
# for the real model (worker/text/tool_formats.py). `tool_template` fills in one family's call
# format; QWEN is here because the constrained-decoding benchmark needs a tool-calling
# model. The other families only tests use: tests/families.py.
_SYSTEM = ("{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
           "<|im_end|>\n{% endif %}")
_TOOLS_INTRO = ("{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more "
                "functions to assist with the user query.\n<tools>{% for tool in tools %}\n"
                "{{ tool | tojson }}{% endfor %}\n</tools>\n")
_TURNS = (
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ message.content or '' }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ CALL }}"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
)
# A past call's arguments as the JSON object they are (strings pass through as sent).
ARGS_JSON = "{{ tool_call.arguments | tojson if tool_call.arguments is not string else tool_call.arguments }}"


def tool_template(name: str, call: str, special_tokens: tuple[str, ...] = (), *,
                  instructions: str = "", generation_prefix: str = "") -> ChatTemplate:
    """A tool-calling ChatML template. `call` renders one past call (Jinja, with
    `tool_call.name` and `tool_call.arguments`); `instructions` follows the tool list in
    the system turn; `generation_prefix` follows the assistant's opening (e.g. <think>)."""
    return ChatTemplate(name, (
        _TOOLS_INTRO + instructions + "<|im_end|>\n{% else %}" + _SYSTEM + "{% endif %}"
        + _TURNS.replace("{{ CALL }}", call)
        + "{% if add_generation_prompt %}<|im_start|>assistant\n" + generation_prefix
        + "{% endif %}"), special_tokens)


# Hermes / Qwen2.5 / Qwen3: <tool_call>{json}</tool_call>, <think>…</think>; the generation
# prompt opens <think> unless enable_thinking is false (Qwen3-thinking, DeepSeek-R1 style),
# so the answer starts as reasoning.
QWEN = tool_template(
    "qwen",
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": " + ARGS_JSON
    + "}\n</tool_call>",
    ("<tool_call>", "</tool_call>", "<think>", "</think>"),
    instructions="Return each call as <tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call>",
    generation_prefix="{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


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


def _train_tokenizer(vocab_size: int, template: ChatTemplate, corpus: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extra = list(template.special_tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(extra),
        special_tokens=SPECIAL_TOKENS + extra,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_CORPUS + list(corpus)) * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=extra or None,
    )
    fast.chat_template = template.text
    return fast


def build_model(path: str | Path, preset: str = "tiny", *, seed: int = 0,
                context_length: int = 4096, template: ChatTemplate = CHATML,
                corpus: tuple[str, ...] = ()) -> BuiltModel:
    """Build a random-weight model at `path` (atomically; reused if already there).
    `template` is its chat template and added special tokens: plain ChatML (no tools),
    QWEN, or a family of tests/families.py. `corpus`: more text its tokenizer learns
    from (a reranker's tokenizer must hold "yes" and "no" as single tokens)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = Path(path)
    arch = dict(PRESETS[preset])
    model_type = arch.pop("model_type", "qwen2")
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltModel(path, meta["context_length"], meta["vocab_size"])

    tokenizer = _train_tokenizer(arch["vocab_size"], template, corpus)
    vocab_size = max(arch["vocab_size"], len(tokenizer))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
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
    if model_type == "qwen3_next":  # dense: every layer an MLP, no experts
        config["mlp_only_layers"] = list(range(arch["num_hidden_layers"]))
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
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

    save_model_dir(path, weights, config, tokenizer,
                   {"preset": preset, "family": template.name, "seed": seed,
                    "context_length": context_length, "vocab_size": vocab_size})
    return BuiltModel(path, context_length, vocab_size)


def save_model_dir(path: Path, weights: dict, config: dict, tokenizer, meta: dict, *,
                   weights_format: str = "mlx", extra=None) -> None:
    """Write a random-weight model directory atomically (a temporary sibling renamed into
    place; a model another process built first wins): weights, config.json, the
    tokenizer, the marker with `meta`, and whatever `extra(folder)` adds."""
    import mlx.core as mx

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights,
                            metadata={"format": weights_format})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        if extra is not None:
            extra(tmp)
        meta = {**meta, "note": "random weights: output is meaningless"}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, path)
        except OSError:  # another process built it first
            if not (path / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
