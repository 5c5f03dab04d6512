"""The engine of a vision-language model: a TextEngine over its language model and its
tokenizer, whose prompts may carry images.

Everything per sequence is the text engine's (samplers, logits processors, grammars,
stop strings, logprobs, tool and reasoning parsing): mlx-vlm's generation step takes the
same samplers and processors as mlx-lm's. What differs is the prompt: the messages keep
their {"type": "image"} parts for the template, and the model's own processor (its
image processor and tokenizer, as mlx-vlm loads them) turns the rendered text and the
decoded images (worker/vision/images.py: bounded by the pixels their headers declare,
then decoded no larger than the processor keeps) into token ids, with one image token per patch the image is cut into,
and the pixel arrays. That runs on the preparation thread, in numpy, like the rest of
`prepare`: the MLX thread only turns the arrays into MLX ones when the request starts.

An image's tokens are the same ids whatever the image shows, so the KV cache knows an
image prompt by its ids with each image's tokens replaced by one id made of that image's
bytes (`media_key`, past any vocabulary): the same words about another image share only
what comes before it; the next turn about the same image finds its state. Nor does that
turn run the image processor again: its output is kept by the images' bytes
(worker/vision/processed.py).

A model whose mlx-vlm class hears audio (worker/vision/audio.py: Gemma 4's audio tower)
takes {"type": "audio"} parts the same way: the clips decoded, the processor's feature
extractor making their mel frames and its audio placeholder as many audio tokens as the
clip lasts, each clip's tokens in the cache key as its bytes' id, as an image's are.
"""

from __future__ import annotations

import hashlib
import io

from protocol.messages import INVALID_REQUEST, Generate, OutputSpec, SamplingParams
from worker.text import prompt as chat_prompt
from worker.text.engine import Prepared, TextEngine
from worker.errors import RequestError
from worker.vision.audio import Hearing, decode_clips
from worker.vision.images import Limits, decode_images
from worker.vision.processed import Remembered

# Where a request's cache key rides with its processed images (`Prepared.media`).
KEY = "mlxd_cache_key"
# Keys of the processor's output that are not keyword arguments of the model's step.
_NOT_KWARGS = ("input_ids", "pixel_values", "attention_mask", KEY)
# Image ids of the cache key: at and above this (uint32, as the disk tier keeps tokens).
_KEY_BASE = 1 << 31
# The processor's arrays an encoder reads: an image's pixels, a clip's mel frames.
_ENCODED = ("pixel_values", "input_features")


_IMAGE_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
_AUDIO_TOKENS = ("audio_token_id", "audio_token_index")


def _token_ids(config, names) -> frozenset:
    ids = (getattr(config, n, None) for n in names)
    return frozenset(i for i in ids if isinstance(i, int) and i >= 0)


def media_tokens(config) -> frozenset:
    """The token ids that stand for an image's (a video's, an audio clip's) features in
    `config`'s prompts."""
    return _token_ids(config, _IMAGE_TOKENS + _AUDIO_TOKENS)


def media_key(ids: list[int], kinds: list[tuple[frozenset, tuple]]) -> list[int]:
    """`ids` with the tokens of each image (audio clip) replaced by an id made of its
    bytes' digest: `kinds` pairs a kind's tokens with its digests (SHA-256, one an image
    or a clip, in order); the k-th run of a kind's tokens is its k-th medium's (when
    there are as many runs as media; otherwise every run of that kind gets an id made of
    all of them, which never reuses wrongly)."""
    key = list(ids)
    for tokens, digests in kinds:
        runs, start = [], None
        for i, t in enumerate(ids + [-1]):
            if t in tokens and start is None:
                start = i
            elif t not in tokens and start is not None:
                runs.append((start, i))
                start = None
        if len(runs) != len(digests):
            digests = [hashlib.sha256(b"".join(digests)).digest()] * len(runs)
        for (a, b), digest in zip(runs, digests):
            key[a:b] = [_KEY_BASE | int.from_bytes(digest[:4], "little") >> 1] * (b - a)
    return key


def encoded(media: dict | None) -> bool:
    """Whether a request's processed media hold anything an encoder (the vision or the
    audio tower) turns into features."""
    return any((media or {}).get(k) is not None for k in _ENCODED)


def model_inputs(media: dict | None) -> tuple:
    """(pixel values, attention mask, the other keyword arguments) of mlx-vlm's step, as
    MLX arrays, from a request's processed images (None each where it has none). The
    mask is the processor's (all ones: one prompt), which Gemma 3's step needs; pixels
    of images of different sizes stay a list (Gemma 4's tower takes them so)."""
    import mlx.core as mx

    media = media or {}
    pixels, mask = media.get("pixel_values"), media.get("attention_mask")
    if isinstance(pixels, list):
        pixels = [mx.array(p) for p in pixels]
    return (mx.array(pixels) if pixels is not None and not isinstance(pixels, list) else pixels,
            mx.array(mask) if mask is not None else None,
            {k: mx.array(v) for k, v in media.items() if k not in _NOT_KWARGS})


def warm_requests(hears: bool = False) -> list[Generate]:
    """A short text request and a short image request (a grey 64×64 PNG), and for a
    model that hears audio (`hears`) a short clip (a fifth of a second of silence, WAV):
    what a vision worker runs before Ready, so the first client request pays no compile."""
    import wave

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(buf, format="PNG")
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    gens = [Generate(rid="warm-text", messages=[{"role": "user", "content": "Hi"}],
                     sampling=sampling, output=OutputSpec()),
            Generate(rid="warm-image", images=(buf.getvalue(),), sampling=sampling,
                     messages=[{"role": "user", "content": [
                         {"type": "image"}, {"type": "text", "text": "Hi"}]}],
                     output=OutputSpec())]
    if hears:
        clip = io.BytesIO()
        with wave.open(clip, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16_000)
            w.writeframes(bytes(2 * 3_200))
        gens.append(Generate(rid="warm-audio", audios=(clip.getvalue(),), sampling=sampling,
                             messages=[{"role": "user", "content": [
                                 {"type": "audio"}, {"type": "text", "text": "Hi"}]}],
                             output=OutputSpec()))
    return gens


def remember_images(processor):
    """`processor`'s image processor made `Remembered` (worker/vision/processed.py), or None
    where it has none or is mlx-vlm's own kind (which mlx-vlm calls otherwise)."""
    from mlx_vlm.models.base import BaseImageProcessor

    inner = getattr(processor, "image_processor", None)
    if inner is None or isinstance(inner, BaseImageProcessor):
        return None
    if not isinstance(inner, Remembered):
        processor.image_processor = Remembered(inner)
    return processor.image_processor


def streaming_detokenizer(tokenizer):
    """mlx-lm's streaming detokenizer for `tokenizer`, chosen by its tokenizer.json's
    decoder as mlx-lm's own `load` chooses it (a text model's engine has it so). mlx-vlm
    hands over the tokenizer alone, and a TokenizerWrapper made from it gets the naive
    one, which decodes the whole line so far at every token: on a 256-token line 12.7 us
    a token against the BPE one's 1.1 (this CPU, a sequence's every token)."""
    import json
    from functools import partial
    from pathlib import Path

    from mlx_lm import tokenizer_utils as tu

    try:
        path = Path(getattr(tokenizer, "name_or_path", "") or "") / "tokenizer.json"
        decoder = json.loads(path.read_text(encoding="utf-8")).get("decoder")
    except (OSError, ValueError):  # (no tokenizer.json: a slow tokenizer's files)
        decoder = None
    if decoder:
        if tu._is_spm_decoder(decoder):
            return tu.SPMStreamingDetokenizer
        if tu._is_spm_decoder_no_space(decoder):
            return partial(tu.SPMStreamingDetokenizer, trim_space=False)
        if tu._is_bpe_decoder(decoder):
            return tu.BPEStreamingDetokenizer
    return tu.NaiveStreamingDetokenizer


class VisionEngine(TextEngine):
    def __init__(self, vlm, processor, context_length: int, prefill_step: int = 512,
                 vocab_size: int | None = None, lm=None):
        """`lm`: the language model as mlx-lm's text model (worker/vision/language.py),
        for the text batch; None: mlx-vlm's own (worker/vision/serial.py)."""
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
        if getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = getattr(processor, "chat_template", None)
        super().__init__(lm or vlm.language_model,
                         TokenizerWrapper(tokenizer, streaming_detokenizer(tokenizer)),
                         context_length, prefill_step, vocab_size)
        self.vlm = vlm
        self.processor = processor
        self._media: dict[str, dict] = {}  # rid → processed images, prompt_ids → prepare
        self.limits = Limits.of(getattr(processor, "image_processor", None))
        self.processed = remember_images(processor)  # (None: the processor's own way)
        self.hearing = Hearing.of(vlm, processor)   # (None: refuses audio parts)
        self.reads = ("image", "audio") if self.hearing else ("image",)

    def prepare(self, gen):
        try:
            prep = super().prepare(gen)
            if isinstance(prep, Prepared):
                prep.media = self._media.get(gen.rid)
            return prep
        finally:
            self._media.pop(gen.rid, None)

    def prompt_ids(self, gen, bound: bool = True) -> tuple[list[int], str]:
        if not gen.images and not (gen.audios and self.hearing):
            return super().prompt_ids(gen, bound)  # (audio parts refused as a text model's)
        from mlx_vlm.utils import prepare_inputs

        text, _ = chat_prompt.chat_text(self.tokenizer, gen, self.reads)
        for kind, noun, sent in (("image", "images", gen.images),
                                 ("audio", "audio clips", gen.audios)):
            placed = sum(isinstance(m.get("content"), list) and sum(
                isinstance(p, dict) and p.get("type") == kind for p in m["content"])
                for m in gen.messages if isinstance(m, dict))
            if placed != len(sent):
                raise RequestError(INVALID_REQUEST, f"the messages place {placed} {noun} "
                                   f"and {len(sent)} were sent", "messages")
        digests = tuple(hashlib.sha256(b).digest() for b in gen.images)
        clips = decode_clips(gen.audios, self.hearing) if gen.audios and self.hearing else None

        def run(images: list):
            return prepare_inputs(self.processor, images=images or None, audio=clips,
                                  prompts=[text],
                                  image_token_index=getattr(self.vlm.config,
                                                            "image_token_index", None),
                                  add_special_tokens=False, return_tensors="np")

        def decode() -> list:
            return decode_images(gen.images, self.limits)

        try:
            inputs = (run(decode()) if self.processed is None or not gen.images
                      else self.processed.process(digests, decode, run))
        except RequestError:
            raise
        except Exception as e:  # the processor refused these images (size, mode, count)
            raise RequestError(INVALID_REQUEST, "the model's processor refused the "
                               f"{'images' if gen.images else 'audio'}: "
                               f"{type(e).__name__}", "messages") from None
        ids = [int(t) for t in inputs["input_ids"][0].tolist()]  # (one read, not one a token)
        media = {k: v for k, v in inputs.items() if k != "input_ids"}
        config = self.vlm.config
        media[KEY] = media_key(ids, [
            (_token_ids(config, _IMAGE_TOKENS), digests),
            (_token_ids(config, _AUDIO_TOKENS),
             tuple(hashlib.sha256(b).digest() for b in gen.audios))])
        self._media[gen.rid] = media
        return ids, "messages"
