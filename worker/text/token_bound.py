"""A lower bound on a text's token count from its length alone, without tokenizing it.

A 14 MB message against a 4096-token context is hopeless, but finding that out by
tokenizing costs ~20 s. No token stands for more input bytes than the longest token of
the vocabulary (L), so a text of B bytes has at least ceil(B / L) tokens; when that
already exceeds the context, the request is refused at once.

The bound holds only if the tokenizer cannot swallow input, which is true of the
byte-complete tokenizers chat models use (byte-level BPE: GPT-2 style, Llama 3, Qwen,
Mistral's Tekken; SentencePiece-style BPE with byte fallback: Llama 2, Mistral v1,
Gemma), and only up to what their normalizer may shrink. It is read from the tokenizer's
own description (tokenizers' JSON): anything it does not recognise (a normalizer that
deletes text, a pre-tokenizer that removes whitespace, an unknown-token model, a slow
tokenizer) gives no bound, so such models are tokenized as before, never refused wrongly.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

log = logging.getLogger("worker.text.token_bound")

# Unicode normalizers shrink non-ASCII text at most 4x (NFKC maps a 4-byte mathematical
# letter to its 1-byte ASCII form; NFC composes a 9-byte Hangul jamo run into 3 bytes)
# and leave ASCII as it is.
_UNICODE = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_UNICODE_SHRINK = 4
_NEUTRAL = frozenset({"Prepend", "ByteLevel"})  # only add to the text
# Pre-tokenizers that only split (a Split or Punctuation may also remove: checked apart).
_SPLITTERS = frozenset({"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation",
                        "UnicodeScripts", "Sequence"})


class TokenBound:
    """`at_least(text)`: a lower bound on how many tokens `text` encodes to (0: none)."""

    def __init__(self, tokenizer):
        self.longest: Optional[int] = None   # bytes of input one token covers at most
        self.shrink = 1                      # how much the normalizer may shrink any text
        self.unicode_shrink = 1              # ... and non-ASCII text on top of that
        try:
            self._read(tokenizer)
        except Exception:  # a tokenizer we cannot read gives no bound, never an error
            log.warning("no prompt length bound for this tokenizer", exc_info=True)
            self.longest = None

    def at_least(self, text: str) -> int:
        if self.longest is None or not text:
            return 0
        per_token = self.longest * self.shrink
        if not text.isascii():  # O(1) in CPython: a flag of the string
            per_token *= self.unicode_shrink
        return -(-len(text.encode("utf-8", "surrogatepass")) // per_token)

    # ---- reading the tokenizer --------------------------------------------------------

    def _read(self, tokenizer) -> None:
        backend = _backend(tokenizer)
        if backend is None:
            return  # a slow (Python) tokenizer
        spec = json.loads(backend.to_str())
        model = spec.get("model") or {}
        pre = spec.get("pre_tokenizer")
        byte_level = _has_type(pre, "ByteLevel")
        if not (self._normalizer_ok(spec.get("normalizer")) and _pre_tokenizer_ok(pre)):
            return
        if model.get("type") not in ("BPE", "Unigram"):
            return  # WordPiece / WordLevel map unknown words to one [UNK]
        vocab = model.get("vocab")
        pieces = vocab.keys() if isinstance(vocab, dict) else [p[0] for p in vocab or ()]
        pieces = set(pieces)
        if byte_level and model.get("type") == "BPE":
            from tokenizers.pre_tokenizers import ByteLevel

            if not set(ByteLevel.alphabet()) <= pieces:
                return  # a byte the vocabulary lacks would be dropped
            longest = max(map(len, pieces))  # each character stands for one byte
        elif model.get("byte_fallback"):
            if not all(f"<0x{b:02X}>" in pieces for b in range(256)):
                return
            # UTF-8 length: a "▁" standing for a space counts 3 (an overestimate, safe);
            # one the client typed is 3 bytes of input indeed.
            longest = max(len(p.encode()) for p in pieces)
        else:
            return  # unknown text becomes one <unk> (or vanishes): no bound
        added = [t.get("content", "") for t in spec.get("added_tokens") or ()]
        self.longest = max([longest, *(len(a.encode()) for a in added)])

    def _normalizer_ok(self, node) -> bool:
        """Whether the normalizer shrinks text by a known factor at most (and record it)."""
        if node is None:
            return True
        kind = node.get("type")
        if kind == "Sequence":
            return all(self._normalizer_ok(n) for n in node.get("normalizers") or ())
        if kind in _UNICODE:
            self.unicode_shrink = _UNICODE_SHRINK
            return True
        if kind in _NEUTRAL:
            return True
        if kind == "Replace":
            pattern, content = node.get("pattern") or {}, node.get("content") or ""
            if "String" not in pattern or not content:
                return False  # a regex, or a deletion: unbounded
            self.shrink *= max(1, -(-len(pattern["String"].encode()) // len(content.encode())))
            return True
        return False  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, ...


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind mlx-lm's wrapper, HF's fast tokenizer, or itself."""
    for obj in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        backend = getattr(obj, "backend_tokenizer", None)
        if backend is not None:
            return backend
    return tokenizer if hasattr(tokenizer, "to_str") else None


def _pre_tokenizer_ok(node) -> bool:
    if node is None:
        return True
    if node.get("type") not in _SPLITTERS or node.get("behavior") == "Removed":
        return False
    return all(_pre_tokenizer_ok(n) for n in node.get("pretokenizers") or ())


def _has_type(node, kind: str) -> bool:
    if not isinstance(node, dict):
        return False
    return node.get("type") == kind or any(_has_type(n, kind)
                                           for n in node.get("pretokenizers") or ())
