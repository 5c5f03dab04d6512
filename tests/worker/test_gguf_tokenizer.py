"""The sentencepiece tokenizers a GGUF describes (Llama 2, Mistral, Gemma: tokens, scores
and token types, no merges), rebuilt by worker/loading/gguf/tokenizer.py, against the reference:
the `sentencepiece` library's own model, trained here, written into a GGUF as llama.cpp's
converter writes it."""

from __future__ import annotations

import pytest

from worker.loading.gguf.reader import GGUFFile
from worker.loading.gguf.tokenizer import build

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
          "Local language models run on Apple Silicon.", "café naïve 日本語", "  two  spaces"]
TEXTS = ["The lazy fox runs.", "Hello,  world!\nNew line", "naïve café", "unseen ☃ 😀 bytes",
         " leading space"]


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text("\n".join(CORPUS * 40))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "m"),
                                   vocab_size=300, model_type="bpe", byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2,
                                   # As Llama's and Mistral's: text kept as written.
                                   normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)
    return spm.SentencePieceProcessor(model_file=str(d / "m.model"))


def write_sentencepiece_gguf(path, sp, arch="llama"):
    """As convert_hf_to_gguf's _create_vocab_sentencepiece: every piece with its score
    and type (1 normal, 2 unknown, 3 control, 6 byte)."""
    import gguf

    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                     6 if sp.is_byte(i) else 1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path, sentencepiece_model):
    sp = sentencepiece_model
    tok = build(GGUFFile(write_sentencepiece_gguf(tmp_path / "sp.gguf", sp)))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text), text    # BOS added, as llama.cpp does
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text)), text
    assert tok.eos_token == sp.id_to_piece(sp.eos_id())
