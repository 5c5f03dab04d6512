"""The prefix cache's token trie: mlx-lm's `PromptTrie` with a search whose cost is the
prompt's length, not the cache's size.

mlx-lm's `PromptTrie.search`, when the prompt shares a prefix with stored entries but no
entry ends inside it, looks for the shortest stored entry below that prefix by walking
every stored path under it and copying the path so far at every node: quadratic in an
entry's length and linear in how many entries share the prefix. Chat prompts all share
their template's opening (`<|im_start|>user\\n`), so every cold chat message walked the
whole cache: with thirty 2,000-token entries, ~70 ms of the MLX thread per request on a
CPU, paid before its prefill (bench.gpu measured the chat path's cold prefill at 0.39 x
raw on an H200, where the prefill itself takes ~30 ms).

Here the prompt's own path is walked once, and a longer entry is found by descending one
branch below where the prompt leaves the trie, to the first node that holds a value:
O(prompt + that entry's length). Every entry below that node shares exactly the same
common prefix with the prompt, so any of them serves the same trimmed state; the one
found is not always the shortest (a larger copy before the trim), a cost linear in one
entry rather than a walk of them all. The result has mlx-lm's shape (PromptTrieResult).
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import PromptTrie, PromptTrieResult

_VALUE = "__value__"   # where mlx-lm's trie keeps a node's value


class Trie(PromptTrie):
    def search(self, model: Any, tokens: List[int]) -> PromptTrieResult:
        node = self._trie.get(model)
        if node is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and _VALUE in node:
            return PromptTrieResult(model, [], None, None, 0)
        last = -1  # the index of the last prompt token at which an entry ends
        index = 0
        while index < len(tokens) and tokens[index] in node:
            node = node[tokens[index]]
            if _VALUE in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[:last + 1] if last > 0 else None  # (as mlx-lm: not one token)
        longer = None
        if index > 0:
            extra = []
            while _VALUE not in node:  # every leaf holds a value (pop prunes the rest)
                tok = next(iter(node))
                extra.append(tok)
                node = node[tok]
            longer = tokens[:index] + extra
        return PromptTrieResult(model, None, shorter, longer, index)
