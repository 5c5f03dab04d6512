"""How an embedding model turns hidden states into one vector: its own configuration.

Sentence-transformers models say it in files beside the weights: `modules.json` lists
the pipeline (Transformer → Pooling → Normalize), `1_Pooling/config.json` the pooling
mode (CLS token, mean of the tokens, last token, max). mlxd follows that pipeline exactly,
and refuses one it cannot follow (a Dense projection after pooling, say) rather than
return vectors that differ from the model's. A model without those files gets the pooling
its family uses in mlx-embeddings (mean for BERT-style encoders, last token for Qwen3),
normalised, as that library returns them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

MODES = ("cls", "mean", "lasttoken", "max")
_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max"}
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class PoolingConfigError(Exception):
    """The model's pipeline is one mlxd cannot reproduce."""


@dataclass(frozen=True)
class Pooling:
    mode: str | None        # one of MODES; None: the library's own (its `text_embeds`)
    normalize: bool
    matryoshka: tuple[int, ...] | None = None  # widths it was trained to truncate to;
    #                                            () any width, None: not a Matryoshka model

    def pool(self, out, mask: mx.array) -> mx.array:
        """(batch, dim) vectors from a model output (`last_hidden_state`, `text_embeds`)
        and the padding mask (batch, seq) of 1s and 0s."""
        if self.mode is None:
            return out.text_embeds
        hidden = out.last_hidden_state
        m = mask[..., None].astype(hidden.dtype)
        if self.mode == "cls":
            vec = hidden[:, 0]
        elif self.mode == "mean":
            vec = (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)
        elif self.mode == "max":
            vec = mx.where(m > 0, hidden, mx.array(-1e30, hidden.dtype)).max(axis=1)
        else:  # lasttoken: the last real token of each row (rows are right-padded)
            last = mask.astype(mx.int32).sum(axis=1) - 1
            vec = hidden[mx.arange(hidden.shape[0]), last]
        return normalize(vec) if self.normalize else vec


def normalize(vec: mx.array) -> mx.array:
    return vec / mx.maximum(mx.linalg.norm(vec, axis=-1, keepdims=True), 1e-12)


def read(path: Path, config: dict) -> Pooling:
    """The pooling the model at `path` (with config.json `config`) asks for."""
    matryoshka = _matryoshka(config)
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return Pooling(None, True, matryoshka)
    try:
        modules = json.loads(modules_file.read_text())
        types = [m["type"] for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolingConfigError(f"modules.json is unreadable: {e}") from None
    unknown = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown:
        raise PoolingConfigError(
            f"its sentence-transformers pipeline has modules mlxd cannot run: "
            f"{', '.join(t.rsplit('.', 1)[-1] for t in unknown)}")
    mode = None
    if _POOLING in types:
        folder = next(m.get("path", "") for m in modules if m["type"] == _POOLING)
        try:
            pooling = json.loads((Path(path) / folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise PoolingConfigError(f"its pooling config is unreadable: {e}") from None
        modes = [v for k, v in _MODE_KEYS.items() if pooling.get(k)]
        others = [k for k, v in pooling.items()
                  if k.startswith("pooling_mode_") and v and k not in _MODE_KEYS]
        if len(modes) != 1 or others:
            raise PoolingConfigError(
                f"its pooling mode is not one mlxd runs ({', '.join(modes + others) or 'none'}"
                f"; supported: one of {', '.join(MODES)})")
        mode = modes[0]
    return Pooling(mode or "mean", _NORMALIZE in types, matryoshka)


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    """Matryoshka widths from config.json (`matryoshka_dimensions`, or `is_matryoshka`),
    as vLLM reads them: truncating another model's vectors would degrade them silently."""
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims) and dims:
        return tuple(sorted(dims))
    return () if config.get("is_matryoshka") else None
