"""The tokenizer a GGUF describes, rebuilt as a Hugging Face fast tokenizer (`tokenizers`)
with the file's chat template, saved beside the weights so mlx-lm loads it like any other.

A GGUF carries no tokenizer.json: only the vocabulary, the merges (or, for sentencepiece
vocabularies, per-token scores), token types, special token ids and the name of the
pre-tokenizer llama.cpp applies (`tokenizer.ggml.pre`). The split rules below are
llama.cpp's for those names (llama-vocab.cpp), written as the `tokenizers` pipelines the
original Hugging Face tokenizers use. A pre-tokenizer not listed is an error, not a guess:
a wrong split tokenizes text differently from training and the model degrades silently.
"""

from __future__ import annotations

from worker.loading.gguf.reader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (llama_token_type)

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → the regex split before byte-level BPE (None: GPT-2's own split).
SPLITS = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": "digits",  # GPT-2's split after cutting digits one by one (SmolLM, StarCoder)
    "starcoder": "digits", "refact": "digits",
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "tekken": _TEKKEN,
}


def build(g: GGUFFile):
    """A `transformers.PreTrainedTokenizerFast` for the file's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from transformers import PreTrainedTokenizerFast

    kind = g.get("tokenizer.ggml.model")
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{g.path.name} carries no tokenizer (tokenizer.ggml.tokens)")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = Tokenizer(_byte_level_bpe(g, tokens))
        tok.pre_tokenizer = _byte_level_split(g)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        tok = Tokenizer(_sentencepiece_bpe(g, tokens))
        _sentencepiece_pipeline(tok, g)
    else:
        raise GGUFError(f"{g.path.name}: tokenizer model {kind!r} cannot be converted "
                        f"(supported: gpt2 byte-level BPE, llama sentencepiece)")

    # Control tokens (<|im_end|>) are special: matched whole, skipped when decoding with
    # skip_special_tokens. User-defined ones (<think>) are matched whole and kept.
    special = [t for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def named(key: str) -> str | None:
        index = g.get(f"tokenizer.ggml.{key}")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    bos = named("bos_token_id")
    if g.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"), pad_token=named("padding_token_id"),
        clean_up_tokenization_spaces=False)
    template = g.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def eos_token_ids(g: GGUFFile) -> list[int]:
    """Every id that ends a turn: EOS, and end-of-turn / end-of-message where the file
    names them (Llama 3's <|eot_id|> is not its EOS token)."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = g.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _byte_level_bpe(g: GGUFFile, tokens: list[str]):
    from tokenizers import models

    merges = g.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{g.path.name}: a byte-level BPE vocabulary without merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    return models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                      byte_fallback=False)


def _byte_level_split(g: GGUFFile):
    from tokenizers import Regex, pre_tokenizers

    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise GGUFError(f"{g.path.name}: pre-tokenizer {pre!r} is not supported "
                        f"(supported: {', '.join(sorted(SPLITS))})")
    split = SPLITS[pre]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _sentencepiece_bpe(g: GGUFFile, tokens: list[str]):
    """Sentencepiece BPE (Llama 2, Mistral, Gemma) as `tokenizers` holds it: merges
    recovered from the vocabulary, ranked by the merged piece's score, as transformers'
    own sentencepiece converter does; unknown bytes fall back to <0xNN> tokens."""
    from tokenizers import models

    scores = g.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFError(f"{g.path.name}: a sentencepiece vocabulary without scores")
    if g.arch.startswith("gemma"):
        # Gemma's file order is its merge order; its scores are not (transformers'
        # GGUF Gemma converter ranks by position for the same reason). Runs of spaces
        # are stored as spaces; sentencepiece spells them with ▁.
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = g.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk = g.get("tokenizer.ggml.unknown_token_id")
    return models.BPE(vocab, pairs, unk_token=tokens[unk] if isinstance(unk, int) else None,
                      fuse_unk=True, byte_fallback=True)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple]:
    merges = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in merges]


def _sentencepiece_pipeline(tok, g: GGUFFile) -> None:
    """Spaces become ▁ (and a leading one is added where the model wants it); decoding
    turns ▁ back into spaces, <0xNN> tokens into bytes, and drops the added space."""
    from tokenizers import decoders, normalizers

    prefix = g.get("tokenizer.ggml.add_space_prefix", not g.arch.startswith("gemma"))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
