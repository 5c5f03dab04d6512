"""Tiny random-weight embedding models in real formats, built locally with no download.

`demo-embed` is a BERT encoder in the layout mlx-embeddings loads (config.json,
model.safetensors, a tokenizer that adds [CLS] and [SEP]) with a sentence-transformers
pipeline beside it (modules.json: mean pooling, then normalisation), as models such as
all-MiniLM or bge ship. `qwen3` builds the other common shape, a causal LM pooled at its
last token (Qwen3-Embedding). `build_cross_encoder` makes rerankers with a classification
head, saved as Hugging Face saves them (BERT as ms-marco MiniLM, XLM-RoBERTa as
bge-reranker). Float32 (MLX's CPU backend runs it fastest); the marker file says the
weights are random, as for worker/demos/text.py's models.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.demos.text import _CORPUS, MARKER, save_model_dir

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# XLM-RoBERTa's specials, in its order: <pad> is id 1, the padding index of its positions.
ROBERTA_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
EMBED_PRESETS = {
    # A MiniLM-shaped BERT, shrunk: 64 wide, so a request costs nothing on a CPU.
    "bert": dict(model_type="bert", architectures=["BertModel"], hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                 hidden_act="gelu", matryoshka_dimensions=[16, 32, 64]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3Model"], hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
}
POOLING = {"bert": "mean", "qwen3": "lasttoken"}
CROSS_ENCODERS = {
    "bert": dict(model_type="bert", architectures=["BertForSequenceClassification"],
                 hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=512, type_vocab_size=2,
                 layer_norm_eps=1e-12, hidden_act="gelu", id2label={"0": "LABEL_0"}),
    "xlm-roberta": dict(model_type="xlm-roberta",
                        architectures=["XLMRobertaForSequenceClassification"], hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                        pad_token_id=1, hidden_act="gelu", id2label={"0": "LABEL_0"}),
}


def _tokenizer(vocab_size: int, preset: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    roberta = preset == "xlm-roberta"
    special = ROBERTA_SPECIAL if roberta else SPECIAL
    tok = Tokenizer(models.BPE(unk_token=special[3] if roberta else "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    ids = {s: tok.token_to_id(s) for s in special}
    if roberta:  # <s> a </s></s> b </s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                                       sep_token="</s>", mask_token="<mask>",
                                       model_input_names=["input_ids", "attention_mask"])
    if preset == "bert":  # [CLS] a [SEP] b [SEP], the second segment typed 1
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    else:  # last-token pooling reads an end token, as Qwen3-Embedding appends one
        tok.post_processor = processors.TemplateProcessing(
            single="$A [SEP]", pair="$A [SEP] $B [SEP]",
            special_tokens=[("[SEP]", ids["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids",
                                                      "attention_mask"])


def build_embedding_model(path: str | Path, preset: str = "bert", *, seed: int = 0,
                          vocab_size: int = 1024) -> Path:
    """Build a random-weight embedding model at `path` (atomically; reused if there)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = Path(path)
    if (path / MARKER).exists():
        return path
    tokenizer = _tokenizer(vocab_size, preset)
    config = {**EMBED_PRESETS[preset], "vocab_size": len(tokenizer),
              "pad_token_id": tokenizer.pad_token_id, "torch_dtype": "float32"}
    module = importlib.import_module(f"mlx_embeddings.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)

    save_model_dir(path, weights, config, tokenizer,
                   {"preset": f"embed-{preset}", "seed": seed, "vocab_size": len(tokenizer)},
                   extra=lambda folder: _sentence_transformers(folder, POOLING[preset],
                                                               config["hidden_size"]))
    return path


def _sentence_transformers(folder: Path, mode: str, width: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
            "lasttoken": "pooling_mode_lasttoken", "max": "pooling_mode_max_tokens"}
    pooling = {"word_embedding_dimension": width, **{k: name == mode for name, k in keys.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "2_Normalize").mkdir()


def build_cross_encoder(path: str | Path, preset: str = "xlm-roberta", *, seed: int = 0,
                        vocab_size: int = 1024) -> Path:
    """Build a random-weight cross-encoder reranker at `path` (reused if there): the
    encoder under its Hugging Face prefix (`bert.`, `roberta.`) and a one-label
    `classifier`, as transformers saves a *ForSequenceClassification model."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert, xlm_roberta

    path = Path(path)
    if (path / MARKER).exists():
        return path
    tokenizer = _tokenizer(vocab_size, preset)
    config = {**CROSS_ENCODERS[preset], "vocab_size": len(tokenizer), "torch_dtype": "float32"}
    mx.random.seed(seed)
    hidden = config["hidden_size"]
    if preset == "bert":
        encoder = bert.Model(bert.ModelArgs.from_dict(config))
        prefix = "bert."
        head = {"classifier.weight": nn.Linear(hidden, 1).weight,
                "classifier.bias": nn.Linear(hidden, 1).bias}
    else:
        encoder = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(
            {**config, "add_pooling_layer": False}))
        prefix = "roberta."
        dense, out = nn.Linear(hidden, hidden), nn.Linear(hidden, 1)
        head = {"classifier.dense.weight": dense.weight, "classifier.dense.bias": dense.bias,
                "classifier.out_proj.weight": out.weight, "classifier.out_proj.bias": out.bias}
    weights = {prefix + k: v for k, v in tree_flatten(encoder.parameters())}
    weights.update(head)
    mx.eval(weights)
    # Saved as transformers saves a checkpoint ("pt"), which is what such models ship as.
    save_model_dir(path, weights, config, tokenizer,
                   {"preset": f"cross-encoder-{preset}", "seed": seed,
                    "vocab_size": len(tokenizer)}, weights_format="pt")
    return path
