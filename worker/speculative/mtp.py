"""The checkpoint's own multi-token-prediction head as a drafter (`--speculative mtp`).

Qwen3.5/3.6 checkpoints ship an MTP block beside the model (`mtp.*` weights, config key
`mtp_num_hidden_layers`) that mlx-lm drops on load. Given the target's last hidden state
at position t (after its final norm) and the embedding of the token at t+1, it predicts
the token at t+2: `fc([norm_e(embed(x[t+1])), norm_h(h[t])])`, one full-attention
decoder layer with its own KV cache over the positions before, a norm, and the target's
own LM head. Its draft costs one small layer, not a second model.

Why not mlx-vlm's `Qwen3_5MTPDraftModel`: its decoder layer is mlx-vlm's (another
attention signature), and its state is one batch whose rows are the rounds of its own
generate loop; here sequences join and leave mlx-lm's batch at any step, so each keeps
its own MTP cache (`MTPDrafter`), and the layer is mlx-lm's `DecoderLayer` of the same
family as the target (the weights load by the same names). The weights are read from the
checkpoint's safetensors by their `mtp.` names, the Hugging Face layout's zero-centred
norms shifted as mlx-vlm's sanitize does.

Inside the batch (worker/speculative/verify.py) the verify forward runs the target's body
and head as two calls (`MTPSpeculation.forward`): the same computation as the model's own
call, whose hidden states are then at hand for every row at no second forward. As the
step accepts each row's tokens (`observe`), the row's kept positions' hidden states go
through the head with the tokens that followed them (the accepted drafts and the token
sampled next), appending those positions to its MTP cache, and its next draft follows,
chained from the head's own output where the sequence's pace asks for more than one
token (greedy, or at temperature > 0 sampled from the head's distribution under the
sequence's sampling chain, for verify.py's rejection sampling: rejection.py); those
speculative positions are trimmed from its MTP cache at the next step;
every row's draft is evaluated at once when the next step asks for the first. A step
where the row took no hidden state (a plain mlx-lm step while every sequence rested)
leaves a gap: it drafts again after one verify step without a draft.

Not yet: each row runs the head by itself, so a step reads the head's layer and the LM
head once per drafting row and chained token; on a large model with many streams that
costs more than it saves (one batched pass over every row's positions, with only the
attention per row, is the next step). A sequence resumed from the prompt cache starts
its head cache empty.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from worker.errors import LoadError
from worker.speculative import rejection
from worker.speculative.adaptive import Speculation

# Norms the Hugging Face layout stores zero-centred (weight - 1): mlx-vlm's rule.
_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
            ".q_norm.weight", ".k_norm.weight", "norm.weight",
            "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
# A chained draft (the head fed its own output) degrades fast: mlx-vlm drafts
# mtp_num_hidden_layers + 1 tokens a round by default.
MAX_DRAFT = 3


def _text(model):
    """mlx-lm's text model inside `model` (a Qwen3.5 checkpoint loads as a wrapper with
    `language_model`)."""
    return getattr(model, "language_model", model)


def body_and_head(model):
    """(the target's body: tokens -> final-norm hidden states, its LM head)."""
    lm = _text(model)
    head = getattr(lm, "lm_head", None)
    if getattr(lm.args, "tie_word_embeddings", False) or head is None:
        head = lm.model.embed_tokens.as_linear
    return lm.model, head


class MTPHead(nn.Module):
    """Qwen3.5's MTP block (module doc); its layers are the target family's own."""

    def __init__(self, args, layers: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer

        size, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        # (A full-attention layer: the index of the family's first attention layer.)
        self.layers = [DecoderLayer(args, args.full_attention_interval - 1)
                       for _ in range(layers)]
        self.norm = nn.RMSNorm(size, eps=eps)

    def kv_per_token(self) -> float:
        """Bytes a sequence's head cache holds per token (the batch admits by it)."""
        cache = [KVCache() for _ in self.layers]
        h = mx.zeros((1, 1, self.norm.weight.shape[0]), dtype=self.norm.weight.dtype)
        self(h, h, cache)
        mx.eval([c.state for c in cache])
        return sum((c.keys.nbytes + c.values.nbytes) / c.keys.shape[2] for c in cache)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list) -> mx.array:
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


def load_head(model, path) -> MTPHead:
    """The MTP head of the checkpoint at `path` for `model` (loaded by mlx-lm), in the
    model's dtype; a LoadError naming what is missing where it has none."""
    lm = _text(model)
    args = getattr(lm, "args", None)
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config", config)
    layers = int(text.get("mtp_num_hidden_layers", 0) or 0)
    if type(lm).__module__ != "mlx_lm.models.qwen3_5" or args is None:
        raise LoadError("--speculative mtp: this model's family has no MTP head mlxd "
                        f"can run (Qwen3.5/3.6-style checkpoints have one; this is "
                        f"{config.get('model_type')!r})")
    if getattr(args, "num_experts", 0):
        raise LoadError("--speculative mtp: MoE MTP heads are not supported yet")
    weights = {}
    for f in _shards(Path(path)):
        for key, value in mx.load(str(f)).items():  # (lazy: only the head's are read)
            if "mtp." in key:
                weights[key] = value
    if not layers or not weights:
        raise LoadError("--speculative mtp: the checkpoint has no MTP weights (no "
                        "`mtp.*` tensors or no mtp_num_hidden_layers in its config; "
                        "MLX conversions usually drop them: use the original checkpoint)")
    head = MTPHead(args, layers)
    mine = {}
    for key, value in weights.items():
        top = key.startswith("mtp.")  # the Hugging Face layout: zero-centred norms
        key = key[key.index("mtp.") + 4:]
        if top and key.endswith(_CENTRED) and value.ndim == 1:
            value = value + 1.0
        mine[key] = value
    quant = config.get("quantization")
    if quant and any(k.endswith(".scales") for k in mine):
        nn.quantize(head, quant["group_size"], quant["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in mine)
    try:
        head.load_weights(list(mine.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"--speculative mtp: the checkpoint's MTP weights do not fit "
                        f"its config: {e}"[:500]) from None
    dtype = lm.model.embed_tokens.weight.dtype
    if not quant:
        head.set_dtype(dtype)
    head.eval()
    mx.eval(head.parameters())
    return head


def _shards(path: Path) -> list:
    """The checkpoint's safetensors files that hold `mtp.` weights (by its index, where
    it has one)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text()).get("weight_map", {})
        return sorted({path / f for k, f in names.items() if "mtp." in k})
    return sorted(Path(f) for f in glob.glob(str(path / "*.safetensors")))


class MTPDrafter:
    """One sequence's MTP state: its head's cache, and its next draft, computed (lazily)
    as soon as a verify step has the hidden states and the token that follows them."""

    def __init__(self, head: MTPHead, embed, lm_head):
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.cache = [KVCache() for _ in head.layers]
        self.guess = None       # (k,) the draft that follows the pending token
        self.sampling = None    # rejection.RowSampling: it samples the draft (None: greedy)
        self.q = None           # that draft's q log-probabilities (k, vocab), if sampled
        self.chained = 0        # MTP cache positions of that draft's chain

    def extend(self, tokens) -> None:
        pass  # (the head reads the tokens with their hidden states: `observe`)

    def ready(self) -> bool:
        return True  # (a step without a guess verifies to compute one)

    def observe(self, hidden: mx.array, accepted: list, following: int, k: int):
        """A verify step kept the pending token and `accepted` drafts (hidden: their
        target hidden states, (1, n, H)), then sampled `following`: the head's entries for
        those positions (each hidden state with the token after it), and a draft of up to
        `k` tokens to follow `following` (returned unevaluated)."""
        if self.chained:
            for c in self.cache:
                c.trim(self.chained)
            self.chained = 0
        tokens = mx.array([list(accepted) + [following]], dtype=mx.int32)
        h = self.head(self.embed(tokens), hidden, self.cache)[:, -1:]
        count = max(1, min(k, MAX_DRAFT))
        keys = rejection.keys([self.sampling]) if self.sampling is not None else None
        draft, qs = [], []
        for n in range(count):
            if n:
                h = self.head(self.embed(draft[-1]), h, self.cache)
                self.chained += 1
            token, q = rejection.draft_tokens([self.sampling], self.lm_head(h)[:, -1],
                                              keys[:, n] if keys is not None else None)
            draft.append(token[:, None])
            qs.append(q)
        self.guess = mx.concatenate(draft, axis=1).reshape(-1)
        self.q = mx.concatenate(qs) if self.sampling is not None else None
        return self.guess

    def forget(self) -> None:
        self.guess = None

    def propose(self, k: int) -> list[int]:
        if self.guess is None or k <= 0:
            return []
        guess, self.guess = self.guess, None
        return guess[:k].tolist()


class MTPSpeculation(Speculation):
    """Speculation whose verify forward also keeps the target's hidden states for the
    sequences drafting with the MTP head."""

    always_verify = True  # (a step without drafts still gives the hidden states)

    def __init__(self, model, head: MTPHead):
        super().__init__()
        self.body, self.lm_head = body_and_head(model)
        self.head = head
        self.hidden = None
        self.rows: dict = {}
        self.lazy: list = []

    def drafter(self) -> MTPDrafter:
        return MTPDrafter(self.head, self.body.embed_tokens, self.lm_head)

    def forward(self, gb, inputs):
        self.hidden = self.body(inputs, cache=gb.prompt_cache)
        self.rows = {uid: i for i, uid in enumerate(gb.uids)}
        return self.lm_head(self.hidden)

    def propose(self, uid: int, pending: int, room: int) -> list[int]:
        if self.lazy:  # (every row's draft in one evaluation)
            mx.eval(self.lazy)
            self.lazy = []
        t = self.tracks.get(uid)
        if t is not None and isinstance(t.drafter, MTPDrafter) \
                and t.drafter.guess is None and t.pace.wants():
            return []  # (no hidden state yet: this step takes one, unpenalized)
        return super().propose(uid, pending, room)

    def verified(self, uid: int, draft: list, accepted: int, tokens: list,
                 following: int | None = None) -> None:
        super().verified(uid, draft, accepted, tokens)
        t = self.tracks.get(uid)
        if t is not None and isinstance(t.drafter, MTPDrafter) and uid in self.rows \
                and following is not None:
            i = self.rows[uid]
            self.lazy.append(t.drafter.observe(self.hidden[i:i + 1, :len(tokens) + 1],
                                               tokens, following, t.pace.length))

    def reported(self, responses, fed: bool = False) -> None:
        super().reported(responses, fed)
        for r in responses:  # (a plain step: no hidden state for these tokens)
            t = self.tracks.get(r.uid)
            if t is not None and isinstance(t.drafter, MTPDrafter):
                t.drafter.forget()
