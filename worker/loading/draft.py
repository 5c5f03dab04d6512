"""Loading `--draft-model` (worker/speculative/draft_model.py) beside a text model: where
it cannot work, a LoadError that says why, or drafting off (said in the log), never a
draft that would quietly do nothing or leave rejected tokens in a cache."""

from __future__ import annotations

import logging
from typing import Optional

from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker.kvcache.prefix import PrefixCache
from worker.speculative.adaptive import price
from worker.speculative.cost import ACCEPTANCE, best_draft
from worker.speculative.draft_model import DraftModel, step_cost

log = logging.getLogger("worker.loading.draft")


def load_draft(spec: str, args, engine, batch_kind: str = "text",
               target_per_token: Optional[float] = None,
               verify: Optional[tuple] = None) -> Optional[DraftModel]:
    """`--draft-model` for this worker's model: None where it does not apply (no draft
    asked, no speculation, a vision model or a worker group's rank, a draft whose passes
    cannot pay even at a generous acceptance (`best_draft`): said in the log; a group's
    ranks step together, and a draft is not a step the followers know); a LoadError where
    it cannot work (another vocabulary, a KV cache that cannot give back rejected
    positions). The draft's own KV cache is full precision under --kv-bits too (it holds a
    small model's positions); `target_per_token`: the model's KV bytes per token in its
    format (default: full precision), which sizes the draft's prompt cache; `verify`: what
    a verification must earn on this device (cost.py `verify_price`; None: a verify step
    priced at one plain step), which its passes must pay for as well."""
    import mlx_lm

    from worker.errors import LoadError

    if not spec:
        return None
    if batch_kind != "text" or not args.max_draft_tokens:
        log.warning("--draft-model %s: off for this worker (%s)", spec,
                    f"a {batch_kind}" if batch_kind != "text" else "--max-draft-tokens 0")
        return None
    if args.max_kv_size is not None:
        raise LoadError("--draft-model does not work with --max-kv-size yet (a rotating KV "
                        "cache cannot give back a rejected draft)")
    try:  # (`spec` is a directory: worker/__main__.py resolved it as it does MODEL)
        model, tokenizer = mlx_lm.load(spec)
    except Exception as e:
        raise LoadError(f"could not load the draft model {spec}: {type(e).__name__}: "
                        f"{e}"[:500]) from None
    if tokenizer.get_vocab() != engine.tokenizer.get_vocab():
        raise LoadError(f"the draft model {spec} has another vocabulary than the model it "
                        "drafts for (both must share one tokenizer)")
    if not all(type(c) is KVCache for c in make_prompt_cache(model)):
        raise LoadError(f"the draft model {spec} has a KV cache that cannot give back a "
                        "rejected draft (attention layers only)")
    cost = step_cost(model, engine.model)
    longest = args.max_draft_tokens
    k, rate = best_draft(cost, 1.0 if verify is None else
                         (lambda d: 1 + price(verify, longest, d)), longest=longest)
    if not k:  # (k passes and a verify step cost more than the tokens they bring)
        log.warning("--draft-model %s: off, a pass of it costs %.2f of the model's own step: "
                    "even at %.0f%% acceptance no draft length brings more than the one "
                    "token a step does (it cannot pay)", spec, cost, ACCEPTANCE * 100)
        return None
    log.info("draft model %s loaded: a pass costs %.2f of the model's step; at %.0f%% "
             "acceptance a draft of %d brings %.2f tokens per step", spec, cost,
             ACCEPTANCE * 100, k, rate)
    return DraftModel(model, args.prefill_step, cost,
                      prefix=_prefix(model, engine, args, target_per_token))


def _prefix(draft, engine, args, target_per_token=None) -> Optional[PrefixCache]:
    """The draft model's prompt cache: as many tokens as the model's own holds
    (--prompt-cache-bytes, in the draft's bytes per token; none where the model has
    none)."""
    if not getattr(args, "prompt_cache_bytes", 0):
        return None
    from worker.loop.sizing import KVSize

    target = target_per_token or KVSize.measure(engine.model).per_token
    ratio = KVSize.measure(draft).per_token / max(1.0, target)
    return PrefixCache(int(args.prompt_cache_bytes * ratio))
