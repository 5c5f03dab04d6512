"""A tiny random-weight Whisper in mlx-audio's real format, built locally with no
download: the speech-to-text model of the tests, the benchmarks and the demo.

The directory is what an `mlx-community/whisper-*` checkpoint holds, and
`mlx_audio.stt.utils.load_model(path)` reads it like one:

- config.json: `model_type: whisper` (which picks mlx_audio.stt.models.whisper) and
  the dimensions in MLX form (`n_mels`, `n_audio_ctx`, `n_text_state`, ...) that
  `ModelDimensions.from_dict` reads.
- model.safetensors: float32 weights under the MLX key names (`encoder.blocks.0.attn.query
  .weight`, convolutions as (out, kernel, in)); `Model.sanitize` passes them through and
  casts them to float16, the dtype mlx-audio's Whisper always runs in.
- the Hugging Face processor files that Whisper's `post_load_hook` reads with
  `WhisperProcessor.from_pretrained`: tokenizer.json (+ vocab.json, merges.txt),
  tokenizer_config.json, special_tokens_map.json, preprocessor_config.json /
  processor_config.json (a WhisperFeatureExtractor of `n_mels` bins); and
  generation_config.json, whose `alignment_heads` serve word timestamps.

The vocabulary has multilingual Whisper's layout, because mlx-audio derives everything from
it: a model is multilingual (language and task tokens in the prompt, language detection,
translation) only if `n_vocab >= 51865`, and the special tokens sit at Whisper's ids:
<|endoftext|> 50257, <|startoftranscript|> 50258, the 99 languages 50259-50357,
<|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nocaptions|>,
<|notimestamps|> 50358-50363, then the timestamps <|0.00|>..<|30.00|> 50364-51864. Below
50257 only a byte-level BPE of a few hundred tokens is real (trained in-process); the ids
between it and 50257 are unused (no token; the model never picks them). So the embedding
has 51865 rows whatever the size.

What it says (the weights are random, but shaped so that the structure holds; the build
says how): each 30-s window opens with <|0.00|> and ends after 0 to 11 text tokens (the
text ends at decoder positions 11, 23, 35, ...: where it starts depends on the prompt of
earlier text), so mlx-audio's seek loop makes it one segment, from the window's start to
the end of its audio (a 65-s clip: 0-30, 30-60, 60-65); greedy decoding is confident
enough that no window falls back to sampling; the language, the task and the audio all
change the text.

`tiny` (tests): width 64, 2 heads, 1+2 layers (14 MB). `small` (the benchmark's) has
whisper-tiny's real shape: width 384, 6 heads, 4+4 layers (149 MB). mlx-audio runs both
in float16, whose matmuls on a CPU do not go through BLAS (~5 GFLOP/s on a 2-core EPYC,
against ~200 in float32 with OpenBLAS): `model.set_dtype(mx.float32)`, `model.dtype =
mx.float32` and `generate(..., fp16=False)` run it in float32, with the same text.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.demos.text import _CORPUS, MARKER, BuiltModel, save_model_dir

SIZES = {
    "tiny": dict(state=64, heads=2, audio_layers=1, text_layers=2),
    "small": dict(state=384, heads=6, audio_layers=4, text_layers=4),
}
N_MELS, AUDIO_CTX, TEXT_CTX = 80, 1500, 448  # 30-s windows of 3000 mel frames
EOT, N_VOCAB = 50257, 51865                   # multilingual Whisper (v1/v2) ids
BPE_SIZE = 512
WINDOW_TOKENS = 12  # a window's text ends at the next decoder position p ≡ 11 (mod 12)

_CORPUS_MORE = ("Bonjour, comment allez-vous ? Je vais bien, merci.",
                "Guten Morgen! Wie geht es Ihnen? Danke, gut.",
                "¿Dónde está la estación? Está aquí, a la izquierda.")


def _special_tokens() -> tuple[list[str], list[str]]:
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    specials = (["<|endoftext|>", "<|startoftranscript|>"]
                + [f"<|{code}|>" for code in list(LANGUAGES)[:99]]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                   "<|nocaptions|>", "<|notimestamps|>"])
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    assert EOT + len(specials) + len(stamps) == N_VOCAB
    return specials, stamps


def _whisper_processor():
    """A WhisperProcessor: Whisper's tokenizer over a small trained byte-level BPE, the
    special tokens at Whisper's ids; and a feature extractor of N_MELS bins."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator((list(_CORPUS) + list(_CORPUS_MORE)) * 20, trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    trained = json.loads(bpe.to_str())["model"]
    specials, stamps = _special_tokens()
    # The special tokens go into the BPE vocabulary itself at their ids: tokens added
    # afterwards would be numbered right after the BPE's few hundred.
    vocab = {**trained["vocab"], **{t: EOT + i for i, t in enumerate(specials + stamps)}}
    merges = [tuple(m) for m in trained["merges"]]
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False) for t in specials[1:]]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in stamps])
    extractor = WhisperFeatureExtractor(feature_size=N_MELS)
    # Text tokens that are not whole printable characters (a lone byte of a multi-byte
    # UTF-8 character, a control byte): the model never picks them (its text shows no
    # U+FFFD, no \x05).
    text = {i: decoders.ByteLevel().decode([t]) for t, i in trained["vocab"].items()}
    unprintable = [i for i, t in text.items() if "\ufffd" in t or not t.isprintable()]
    return (WhisperProcessor(extractor, tokenizer), vocab, merges, len(trained["vocab"]),
            unprintable)


def build_stt_model(path: str | Path, size: str = "tiny", *, seed: int = 0) -> BuiltModel:
    """Build the Whisper of `size` at `path` (atomically; reused if already there).
    `context_length` is the decoder's context (448 tokens), `vocab_size` 51865."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_audio.stt.models.whisper.audio import N_SAMPLES, log_mel_spectrogram, pad_or_trim
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    path = Path(path)
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltModel(path, meta["context_length"], meta["vocab_size"])
    processor, vocab, merges, n_text, unprintable = _whisper_processor()
    s = SIZES[size]
    d = s["state"]
    config = {"model_type": "whisper", "n_mels": N_MELS, "n_audio_ctx": AUDIO_CTX,
              "n_audio_state": d, "n_audio_head": s["heads"],
              "n_audio_layer": s["audio_layers"], "n_vocab": N_VOCAB,
              "n_text_ctx": TEXT_CTX, "n_text_state": d, "n_text_head": s["heads"],
              "n_text_layer": s["text_layers"]}
    mx.random.seed(seed)
    model = Model(ModelDimensions.from_dict(config), dtype=mx.float32)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    rng = np.random.default_rng(seed)

    # What is changed in the random weights, and why. (1) A random decoder's greedy text
    # never ends: it loops to the 224-token limit, then Whisper's temperature fallback
    # decodes the window up to five times more. So two channels of the decoder's residual
    # stream are taken over, read by its final layer norm: channel 0 is a constant (norm
    # weight 0, bias BETA) that makes column 0 of the (tied) embedding a per-token logit
    # bias; channel 1 carries a large value, from the positional embedding, at every
    # WINDOW_TOKENS-th position, where it lifts <|endoftext|> above every text token. No
    # block writes into either channel.
    BETA, ZONE = 50.0, 40.0
    bias = np.full(N_VOCAB, -100.0, np.float32)  # the unused ids: never picked
    bias[:n_text] = 0.0                          # the BPE's text tokens
    bias[unprintable] = -100.0
    bias[EOT] = -20.0                            # <|endoftext|>: only where channel 1 is up
    # Languages, tasks, <|nocaptions|> (no window is skipped as silence), ...: never in
    # the text. Language detection compares the languages among themselves: it still
    # depends on the audio.
    bias[EOT + 1:EOT + 107] = -30.0
    # Timestamps: <|0.00|> first and the rest far behind, so each window opens with
    # <|0.00|> (Whisper's rules force a timestamp there) and none follows; mlx-audio then
    # makes the window one segment, from its start to the end of its audio.
    bias[EOT + 107:] = np.maximum(-30.0 - 3.0 * np.arange(1501), -100.0)
    # (2) Each attention and MLP of a random transformer adds a nearly constant vector
    # (an average over positions or frames), which makes one token win everywhere
    # ("ThThTh"): what varies from position to position, the token and position
    # embeddings, is doubled and those writes halved, and the constant is measured below
    # and taken out.
    emb = weights["decoder.token_embedding.weight"] * 2
    emb[bias <= -100.0, :] = 0.0
    emb[EOT:EOT + 1] = emb[EOT + 107:] = 0.0     # <|endoftext|>, timestamps: their bias only
    emb[:, 0], emb[:, 1], emb[EOT, 1] = bias / BETA, 0.0, 1.0
    weights["decoder.token_embedding.weight"] = emb
    pos = rng.normal(0.0, 2 * d ** -0.5, (TEXT_CTX, d)).astype(np.float32)
    pos[:, :2] = 0.0
    pos[WINDOW_TOKENS - 1::WINDOW_TOKENS, 1] = ZONE
    weights["decoder.positional_embedding"] = pos
    for key, value in weights.items():
        if key.startswith("decoder.blocks.") and key.rsplit(".", 2)[-2] in ("out", "mlp2"):
            value[:2] = 0.0   # rows 0 and 1 of the writes into the residual stream
            value *= 0.5
        # (3) What makes the audio reach the text: the convolutions' features scaled up
        # (at init the encoder's sinusoidal positions outweigh them, so every clip encodes
        # alike), and the text's attention over them sharpened (uniform, it averages 1500
        # frames, mostly the window's padding, into the same vector for any clip).
        if key.startswith("encoder.conv"):
            value *= 3.0
        if key.startswith("decoder.blocks.") and ".cross_attn.query." in key:
            value *= 16.0
    # (4) The final norm's channels 2..: random signs, so the logits do not favour the
    # token just read (the residual holds its embedding); scaled so that text logits
    # spread ~10 apart: greedy output has no near-ties and its log-probabilities stay
    # above Whisper's fallback threshold (-1 a token).
    ln_w, ln_b = weights["decoder.ln.weight"], weights["decoder.ln.bias"]
    ln_w[2:] = 5.0 * rng.choice([-1.0, 1.0], d - 2)
    ln_w[0], ln_b[0] = 0.0, BETA
    ln_w[1], ln_b[1] = 8.0, 0.0
    # The constant of (2), measured on 30 s of noise and a random text, is subtracted
    # where the last block writes.
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    noise = mx.array(rng.normal(0.0, 0.1, N_SAMPLES).astype(np.float32))
    xa = model.encoder(pad_or_trim(log_mel_spectrogram(noise, N_MELS), 3000, axis=-2)[None])
    text = rng.choice(np.flatnonzero(bias[:n_text] == 0.0), 60)
    dec = model.decoder
    tokens = mx.array([[EOT + 1, EOT + 2, EOT + 102, EOT + 107, *text.tolist()]])
    x = dec.token_embedding(tokens) + dec.positional_embedding[:tokens.shape[1]]
    for block in dec.blocks:
        x, _, _ = block(x, xa, mask=dec._mask)
    outside = np.arange(tokens.shape[1]) % WINDOW_TOKENS != WINDOW_TOKENS - 1
    mean = np.array(x[0])[outside].mean(axis=0)
    weights[f"decoder.blocks.{s['text_layers'] - 1}.mlp2.bias"][2:] -= mean[2:]
    weights = {k: mx.array(v) for k, v in weights.items()}
    mx.eval(weights)
    heads = [[layer, h] for layer in range(s["text_layers"] // 2, s["text_layers"])
             for h in range(s["heads"])]

    def processor_files(folder: Path) -> None:
        processor.feature_extractor.save_pretrained(str(folder))  # preprocessor_config.json
        (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (folder / "merges.txt").write_text(
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        specials, _ = _special_tokens()
        (folder / "special_tokens_map.json").write_text(json.dumps({
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "additional_special_tokens": specials[1:]}, indent=2))
        (folder / "generation_config.json").write_text(json.dumps({
            "alignment_heads": heads, "decoder_start_token_id": EOT + 1,
            "eos_token_id": EOT, "pad_token_id": EOT, "no_timestamps_token_id": EOT + 106,
            "is_multilingual": True, "max_length": TEXT_CTX,
            "lang_to_id": {t: EOT + 2 + i for i, t in enumerate(specials[2:101])},
            "task_to_id": {"translate": EOT + 101, "transcribe": EOT + 102}}, indent=2))

    save_model_dir(path, weights, config, processor,
                   {"preset": f"{size}-stt", "family": "whisper", "seed": seed,
                    "context_length": TEXT_CTX, "vocab_size": N_VOCAB},
                   extra=processor_files)
    return BuiltModel(path, TEXT_CTX, N_VOCAB)
