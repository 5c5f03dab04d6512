"""A tiny test model that ends its own replies, for the Open Responses compliance cases.

The random-weight models of worker/demos/text.py never sample EOS (their head's EOS row is
zeroed so that benchmarks get known lengths), so every reply they give runs to its token
budget and ends `incomplete`. The compliance cases send no `max_output_tokens` and expect
`completed`, as a trained model gives. This copies a family model (a real tool-call
template: Qwen3-Coder's <tool_call><function=...>), or the Qwen2-VL demo for the image
case, and edits two weights so that the reply is one sampled token and then EOS,
whatever the prompt:
- every token's embedding but the generation prompt's last one gains a shared direction m;
- the head's EOS row points along m, far above every other row.
At the generation prompt's last position m is absent, so the first token is an ordinary
one; from then on m dominates the residual stream and EOS wins. The whole head is also
sharpened, so sampling at the default temperature picks the argmax or a close second,
and the rows of the tokens that decode to no text of their own (byte fragments, special
tokens) are zeroed, far below the best of the others: the one token is a piece of a word
of the tokenizer's corpus, never one that decodes to nothing or to U+FFFD.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SHARPEN = 16.0  # the head's logits are multiplied by this: sampling is near greedy
EOS_MARGIN = 4.0  # the EOS row's length, in multiples of the longest other row


def build_stopping_model(source: Path, path: Path) -> Path:
    """Copy the model at `source` to `path` (once) with the edit above."""
    import json

    import mlx.core as mx
    from transformers import AutoTokenizer

    marker = path / "stopping.json"
    if marker.exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    weights = mx.load(str(tmp / "model.safetensors"))
    eos = json.loads((tmp / "config.json").read_text())["eos_token_id"]
    tokenizer = AutoTokenizer.from_pretrained(str(tmp))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                           add_generation_prompt=True, tokenize=False)
    last = int(tokenizer.encode(prompt)[-1])
    # A vision-language checkpoint (worker/demos/vision.py) keeps its language model's
    # weights under `language_model.`; image tokens take the vision tower's embeddings,
    # which do not carry m, and the edit is otherwise the same.
    prefix = "language_model." if "language_model.lm_head.weight" in weights else ""
    embed_key, head_key = prefix + "model.embed_tokens.weight", prefix + "lm_head.weight"
    embed, head = weights[embed_key], weights[head_key]
    direction = mx.random.normal((embed.shape[1],), key=mx.random.key(0))
    direction = direction / mx.linalg.norm(direction)
    keep = mx.ones((embed.shape[0], 1)).at[last].add(-1.0)
    embed = embed + keep * direction * mx.linalg.norm(embed, axis=1).mean()
    head = head * SHARPEN
    mute = [t for t in range(head.shape[0]) if t != eos and
            _textless(tokenizer.decode([t], skip_special_tokens=True))]
    head = head.at[mx.array(mute)].multiply(0.0)
    longest = mx.linalg.norm(head, axis=1).max()
    head = head.at[eos].add(direction * longest * EOS_MARGIN)
    weights.update({embed_key: embed, head_key: head})
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    marker_src = tmp / "stopping.json"
    marker_src.write_text(json.dumps({"source": str(source), "last_prompt_token": last}))
    tmp.rename(path)
    return path


def _textless(text: str) -> bool:
    """A token's own text is nothing or holds U+FFFD (a UTF-8 fragment)."""
    return not text or "\ufffd" in text
