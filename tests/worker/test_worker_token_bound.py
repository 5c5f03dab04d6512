"""A hopeless prompt is refused from its byte length, without tokenizing (issue #9, 7).

The bound must never exceed the real token count (a prompt that fits is never refused),
and tokenizers that can swallow text get no bound at all.
"""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from protocol.messages import CONTEXT_LENGTH_EXCEEDED
from tests.generates import generate
from worker.errors import RequestError
from worker.text.token_bound import TokenBound

BIG = "hello world " * (14 * 1024 * 1024 // 12)  # ~14 MB, as in the finding


@pytest.fixture
def no_tokenizing(engine, monkeypatch):
    """Any call that would tokenize fails the test."""
    def boom(*a, **kw):
        raise AssertionError("the prompt was tokenized")

    hf = type(engine.tokenizer._tokenizer)  # every way in, for this tokenizer's class
    for name in ("encode", "__call__", "_encode_plus"):
        monkeypatch.setattr(hf, name, boom)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": BIG}]},
    {"prompt": BIG},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": BIG[: len(BIG) // 2]}], "max_tokens": 10},
])
def test_a_hopeless_prompt_is_refused_without_tokenizing(engine, no_tokenizing, body):
    t0 = time.monotonic()
    with pytest.raises(RequestError) as e:
        engine.prepare(generate(rid="big", **body))
    assert time.monotonic() - t0 < 2.0  # tokenizing 14 MB takes ~20 s
    err = e.value
    assert err.code == CONTEXT_LENGTH_EXCEEDED
    assert err.param == ("messages" if "messages" in body else "prompt")
    assert "at least" in err.message and "4096" in err.message
    assert err.prompt_tokens == 0  # nothing was counted for real


def test_the_bound_counts_the_completion_too(engine, no_tokenizing):
    n, longest = engine.context_length, engine.bound.longest
    text = "x" * ((n - 5) * longest)  # at least n - 5 tokens: room for 5 more only
    assert engine.bound.at_least(text) == n - 5
    with pytest.raises(RequestError) as e:
        engine.prepare(generate(rid="t", prompt=text, max_tokens=6))
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED and "at least" in e.value.message


def test_a_prompt_that_may_fit_is_tokenized_and_judged_exactly(engine):
    # Under the bound's reach: tokenized, then refused (or not) on its real count.
    n = engine.context_length
    text = "hello world " * (n // 2)
    with pytest.raises(RequestError) as e:
        engine.prepare(generate(rid="t", prompt=text))
    assert "at least" not in e.value.message and e.value.prompt_tokens > n
    assert engine.bound.at_least(text) < n


def test_the_bound_never_exceeds_the_real_count(engine):
    tok, bound = engine.tokenizer, engine.bound
    assert bound.longest is not None
    vocab = tok._tokenizer.get_vocab()
    longest_piece = max(vocab, key=len)
    longest_text = tok.decode([vocab[longest_piece]])
    texts = [
        "Once upon a time",
        longest_text * 200,             # the bound's tightest case
        "<|im_start|>" * 50,            # special tokens: one token each, 12 bytes
        "é" * 300 + "e\u0301" * 300,    # normalization (NFC) composes, shrinking bytes
        "\u1100\u1161\u11a8" * 200,     # Hangul jamo: NFC makes 9 bytes into 3
        "日本語のテキスト" * 100,
        " " * 1000 + "\n" * 500,
    ]
    for text in texts:
        real = len(tok.encode(text, add_special_tokens=False))
        assert 0 < bound.at_least(text) <= real, text[:30]


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _byte_level_bpe(normalizer=None) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["hello"] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        t.normalizer = normalizer
    return t


def test_byte_complete_tokenizers_get_a_bound():
    assert TokenBound(_wrap(_byte_level_bpe())).longest == len("hello")
    nfc = TokenBound(_wrap(_byte_level_bpe(normalizers.NFC())))
    assert nfc.at_least("a" * 100) == 20 and nfc.at_least("é" * 100) == 10  # 200 B / (5*4)


@pytest.mark.parametrize("make", [
    # Unknown text collapses to one [UNK] token.
    lambda: Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
    # Whitespace is dropped by the pre-tokenizer.
    lambda: _with(_byte_level_bpe(), pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
    # The normalizer deletes text.
    lambda: _byte_level_bpe(normalizers.Strip()),
    lambda: _byte_level_bpe(normalizers.Replace("abc", "")),
    # A byte-level vocabulary that lacks a byte would drop it.
    lambda: Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])),
], ids=["unk", "whitespace-split", "strip", "replace-deletes", "missing-bytes"])
def test_tokenizers_that_can_swallow_text_get_no_bound(make):
    bound = TokenBound(_wrap(make()))
    assert bound.longest is None and bound.at_least("x" * 10 ** 6) == 0


def _with(t: Tokenizer, pre_tokenizer) -> Tokenizer:
    t.pre_tokenizer = pre_tokenizer
    return t
