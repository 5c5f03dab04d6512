"""--warm-prompt: a system prompt (or a whole chat request) prefilled at load and pinned in
the prompt cache, so the first request after a start, a restart or a swap already starts
from it instead of prefilling an agent's long system prompt and tool list.

The file is plain text (the system prompt) or a chat completions request as JSON
(`messages`, and `tools` as the client sends them). What is prefilled is the part that
every next turn shares, whatever the template: the conversation is rendered with
different user messages after it, and the tokens the renderings share are the prefix (up
to and including the opening of the user turn: the engine's `turn_prefix`, which also
marks where a chat's system prompt ends). Its state is computed once, before the
worker says it is ready, and pinned (worker/kvcache/prefix.py `pin`).

Where the batch drafts with the checkpoint's MTP head, the prompt is prefilled as the
batch prefills one (its speculation's `prompt_reader`: worker/speculative/mtp_prefill.py),
and the head's state is pinned beside the model's: a conversation that starts from the
pinned prefix then has a head that has read all of it, and so have its later entries
(a head cache that starts past position 0 is never kept: worker/speculative/mtp_state.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from protocol.messages import Generate, OutputSpec
from worker.errors import LoadError


def warm_request(path: Path) -> Generate:
    """The file's conversation as a Generate (LoadError if it is not a system prompt or a
    chat request)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LoadError(f"--warm-prompt {path}: cannot read it ({e})") from None
    body = None
    if text.lstrip().startswith("{"):
        try:
            body = json.loads(text)
        except ValueError as e:
            raise LoadError(f"--warm-prompt {path}: not valid JSON ({e})") from None
    if body is None:
        if not text.strip():
            raise LoadError(f"--warm-prompt {path} is empty")
        return Generate(rid="warm-prompt", messages=[{"role": "system", "content": text}])
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) for m in messages):
        raise LoadError(f"--warm-prompt {path}: a chat request needs a non-empty `messages` "
                        "list of objects")
    if tools is not None and not isinstance(tools, list):
        raise LoadError(f"--warm-prompt {path}: `tools` must be a list")
    return Generate(rid="warm-prompt", messages=messages, output=OutputSpec(tools=tools or None))


def prefill(engine, ids: list[int], step: int, max_kv_size=None, kv_format=None,
            reader=None) -> tuple[list, list | None]:
    """(The model's cache after `ids` (in `kv_format`: worker/kvcache/quantized.py),
    prefilled `step` tokens at a time; the drafter's state beside it, or None). `reader`:
    the batch's speculation's `prompt_reader` (None: the model alone). MLX thread."""
    import mlx.core as mx

    from worker.kvcache.quantized import KVFormat

    cache = (kv_format or KVFormat()).make(engine.model, max_kv_size)
    for start in range(0, len(ids), step):
        chunk, more = ids[start:start + step], []
        if reader is None:
            engine.model(mx.array(chunk)[None], cache=cache)
        else:
            more = reader(chunk, cache)
        mx.eval([c.state for c in cache] + more)
    head = reader.state(len(ids)) if reader is not None else None
    if head is not None:
        mx.eval([c.state for c in head])
    return cache, head


def pin_warm_prompt(batch, path: Path, step: int) -> int:
    """Prefill the warm prompt's shared prefix and pin it in `batch`'s prompt cache.
    Returns the tokens pinned (0: nothing to pin)."""
    if batch.kvcache is None:
        raise LoadError("--warm-prompt needs the prompt cache (--prompt-cache-bytes above 0)")
    engine = batch.engine
    try:
        ids = engine.turn_prefix(warm_request(path))  # (worker/text/engine.py)
    except LoadError:
        raise
    except Exception as e:  # the template refused the conversation, say
        raise LoadError(f"--warm-prompt {path}: {getattr(e, 'message', None) or e}") from None
    if len(ids) >= engine.context_length:
        raise LoadError(f"--warm-prompt {path}: {len(ids)} tokens do not fit the context "
                        f"({engine.context_length})")
    if not ids:
        return 0
    spec = batch.speculation  # (the MTP head's reads the prompt too: module doc)
    cache, head = prefill(engine, ids, step, batch.max_kv_size, batch.kv_format,
                          spec.prompt_reader() if spec is not None else None)
    return len(ids) if batch.kvcache.pin(ids, cache, head) else 0
