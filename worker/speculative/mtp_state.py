"""The MTP head's state kept beside the target's (worker/kvcache/prefix.py `head`), so
that a prompt resumed from the prefix cache or a named snapshot has a head that has read
all of it, as a cold prefill's has (without it the head read only the new part, and its
drafts on a resumed agent turn were made over a fraction of the conversation).

Alignment: the head's entry j reads the target's hidden state h[j] with the token x[j+1]
(mtp.py), so beside the target's state of n tokens the head's holds entries 0..n-2 and
h[n-1], which waits for the next token. Kept as cache objects (the head's KVCache per
layer, then an ArraysCache holding h[n-1]), so that the KV cache's tiers count, copy and
write it to disk as they do the target's (worker/kvcache/files.py).

`state_of` takes it from a sequence's drafter where its head holds exactly that:
- while its prompt is prefilled (the KV cache's checkpoints: worker/kvcache/manager.py),
  its own head cache (`prompt`) and `last`;
- once it decodes, its row of the head's batch cache: after a verify step the row has
  read every kept position with the token sampled after it (one entry more than kept:
  cut off) and `tail` is the last one's hidden state; a sequence that ended in a verify
  step kept tokens its head has not read (`final`): one pass of the head reads them, on
  a copy of its row, only when the state is kept.
None where the head's cache does not start at position 0 (a prompt resumed without the
head's state, an image prompt's text after its images: `start`) or holds another number
of positions than that (a plain step took no hidden states: its cache skips that
position from then on, one short); the entry is then kept without it.

`restore` puts a kept state back as the drafter's prompt cache and `last`, so that its
prefill goes on as if its head had read the prompt from the start. An entry without one
(trimmed to a shorter prefix: the hidden state at the cut is not kept) leaves the head
to read what follows the cached part, its cache starting there (`start`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


def pack(cache: list, last: mx.array) -> list:
    """The state as the KV cache keeps it: the head's layers' caches, then h[n-1]."""
    hidden = ArraysCache(1)
    hidden[0] = last
    return list(cache) + [hidden]


def _first(c, n: int) -> KVCache:
    """A KVCache of `c`'s first `n` positions (fewer where it holds fewer: the KV cache
    then refuses the state), in arrays of its own, exactly that long."""
    out = KVCache()
    out.keys = mx.contiguous(c.keys[..., :n, :])
    out.values = mx.contiguous(c.values[..., :n, :])
    out.offset = out.keys.shape[2]
    return out


def state_of(spec, d, n: int) -> list | None:
    """The head's state beside the target's state of the first `n` tokens of the
    sequence drafting with `d` (an MTPDrafter of `spec`, its MTPSpeculation), or None
    (module doc). Lazy: the caller evaluates it with the target's."""
    if d.start or n < 2:
        return None
    if not d.joined:
        if d.prompt is None or d.last is None or d.length != n - 1:
            return None
        return pack([_first(c, n - 1) for c in d.prompt], d.last)
    if d not in spec.batch:
        return None
    i = spec.batch.order.index(d)
    rows = [c.extract(i) for c in spec.batch.cache]  # (its positions, then the last
    if d.final is not None:                          # chain's guesses: cut off)
        hidden, row, tokens = d.final
        if d.length + len(tokens) != n - 1:
            return None
        cache = [_first(c, d.length) for c in rows]
        if tokens:
            spec.head(spec.embed(mx.array([tokens])), hidden[row:row + 1, :len(tokens)],
                      cache)
            cache = [_first(c, n - 1) for c in cache]
        return pack(cache, hidden[row:row + 1, len(tokens):len(tokens) + 1])
    if d.tail is None or d.length != n:
        return None
    hidden, row, at = d.tail
    return pack([_first(c, n - 1) for c in rows], hidden[row:row + 1, at:at + 1])


def restore(d, cached: int, head: list | None, layers: int) -> None:
    """The sequence drafting with `d` starts from a state of its first `cached` prompt
    tokens, `head` the head's state beside it (as `state_of` gave it; None: none kept)."""
    if head is None or cached < 2 or len(head) != layers + 1 \
            or any(c.offset != cached - 1 for c in head[:-1]):
        d.start = cached
        return
    d.prompt, d.last = list(head[:-1]), head[-1][0]
    d.length, d.start = cached - 1, 0
