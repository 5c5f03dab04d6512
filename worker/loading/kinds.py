"""The model kinds a worker serves, one row each: how the model loads, what is built and
warmed before Ready, which loop serves it, and what its Ready says beyond the common
fields. `worker/__main__.py` and `models.load` read the row; neither switches on the
kind, so a new kind is one row here (and its `ModelKind`, with its tasks, in
protocol/messages.py).

Every import of an engine stays inside the row's functions: a worker imports only what
its own kind runs (a speech worker never imports mlx-vlm, a text worker never mlx-audio).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from protocol.messages import ModelKind

log = logging.getLogger("worker")


@dataclass(frozen=True)
class Kind:
    # (path, config, context length, vocab size) -> (MLX model, tokenizer, engine or None):
    # None when the engine is built in `start` from the settings.
    load: Callable[[Path, dict, int, int | None], tuple]
    # (LoadedModel, args) -> (engine, batch or None), warmed: the first request pays no
    # compile. A batch is what the text loop runs; engines without one serve whole jobs.
    start: Callable
    # (engine, batch, link, status, args) -> the loop: `.run()` serves until Shutdown.
    loop: Callable
    # engine -> the fields of Ready that only this kind fills.
    ready: Callable[[object], dict] = lambda engine: {}


def _load_text(path, config, ctx, vocab):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer, None


def _load_vision(path, config, ctx, vocab):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(path))
    return model, processor, None


def _load_embed(path, config, ctx, vocab):
    from worker.pooling.embedder import EmbedEngine

    engine = EmbedEngine.load(path, config, ctx)
    return engine.model, engine.tokenizer, engine


def _load_rerank(path, config, ctx, vocab):
    """A cross-encoder checkpoint (`...ForSequenceClassification`) scores with its own
    head; any other reranker is a causal LM that scores by its yes/no logits."""
    if "ForSequenceClassification" in str(config.get("architectures")):
        from worker.pooling.cross_encoder import CrossEncoder

        engine = CrossEncoder.load(path, config, ctx)
        return engine.encoder, engine.tokenizer, engine
    import mlx_lm

    from worker.pooling.reranker import LMReranker

    model, tokenizer = mlx_lm.load(str(path))
    return model, tokenizer, LMReranker(model, tokenizer, ctx, vocab or len(tokenizer))


def _load_stt(path, config, ctx, vocab):
    from mlx_audio.stt.utils import load_model

    from worker.speech.transcriber import Transcriber

    engine = Transcriber(load_model(str(path)))
    return engine.model, None, engine


def _load_tts(path, config, ctx, vocab):
    from mlx_audio.tts.utils import load_model

    from worker.speech.synthesizer import Synthesizer

    engine = Synthesizer(load_model(path), path)
    return engine.model, None, engine


def _start_text(loaded, args):
    from worker.loading.startup import make_batch
    from worker.text.engine import TextEngine

    engine = TextEngine(loaded.model, loaded.tokenizer, loaded.context_length,
                        args.prefill_step, loaded.vocab_size)
    batch = make_batch(engine, args, loaded.path)
    batch.warm()
    if args.warm_prompt is not None:
        from worker.kvcache.warm import pin_warm_prompt

        pinned = pin_warm_prompt(batch, args.warm_prompt, max(1, args.prefill_step))
        log.info("--warm-prompt: %d tokens prefilled and pinned", pinned)
    return engine, batch


def _start_vision(loaded, args):
    """The text batch over the language model as mlx-lm's text class, its weights
    mlx-vlm's (worker/vision/); one request at a time where mlx-lm has no such class."""
    from worker.vision.engine import VisionEngine
    from worker.vision.language import shared_language_model

    lm = shared_language_model(loaded.model, loaded.path)
    engine = VisionEngine(loaded.model, loaded.tokenizer, loaded.context_length,
                          args.prefill_step, loaded.vocab_size, lm=lm)
    if lm is None:
        if args.kv_bits:  # (never silently full precision: the model opts out by its own 0)
            from worker.errors import LoadError

            raise LoadError("--kv-bits: this vision model runs one request at a time on "
                            "mlx-vlm's own step (mlx-lm has no text class for it), with no "
                            "quantized KV cache; give it full precision: --model-setting "
                            "MODEL:kv_bits=0")
        from worker.vision.serial import SerialBatch

        batch = SerialBatch(engine)
        batch.warm()
        return engine, batch
    from worker.loading.startup import make_batch
    from worker.vision.batch import VisionBatch

    batch = make_batch(engine, args, loaded.path, cls=VisionBatch)
    batch.warm()
    if args.warm_prompt is not None:
        from worker.kvcache.warm import pin_warm_prompt

        pin_warm_prompt(batch, args.warm_prompt, max(1, args.prefill_step))
    return engine, batch


def _start_engine(loaded, args):
    """An engine that serves whole jobs (embedding, reranking, speech): probed once."""
    loaded.engine.probe()
    return loaded.engine, None


def _text_loop(engine, batch, link, status, args):
    from worker.faults import Faults
    from worker.loop.scheduler import Scheduler

    return Scheduler(engine, link, status, batch, log_prompts=args.log_prompts,
                     stream_interval=args.stream_interval,
                     buffer_cache_idle=args.buffer_cache_idle, faults=Faults.from_env())


def _pool_loop(engine, batch, link, status, args):
    from worker.pooling.scheduler import PoolScheduler

    return PoolScheduler(engine, link, status)


def _speech_loop(engine, batch, link, status, args):
    from worker.speech.scheduler import SpeechScheduler

    return SpeechScheduler(engine, link, status)


KINDS: dict[ModelKind, Kind] = {
    ModelKind.TEXT: Kind(_load_text, _start_text, _text_loop),
    ModelKind.VISION: Kind(_load_vision, _start_vision, _text_loop,
                           ready=lambda engine: {"hears_audio": engine.hearing is not None}),
    ModelKind.EMBED: Kind(_load_embed, _start_engine, _pool_loop,
                          ready=lambda engine: {"dimensions": engine.dim}),
    ModelKind.RERANK: Kind(_load_rerank, _start_engine, _pool_loop),
    ModelKind.STT: Kind(_load_stt, _start_engine, _speech_loop,
                        ready=lambda engine: {"sample_rate": engine.sample_rate,
                                              "translates": engine.translates}),
    ModelKind.TTS: Kind(_load_tts, _start_engine, _speech_loop,
                        ready=lambda engine: {"sample_rate": engine.sample_rate,
                                              "voices": list(engine.voices)}),
}
