"""A tiny random-weight text-to-speech model in real mlx-audio format, built locally with
no download: the speech model of the tests, the benchmarks and the demo.

The family is Kyutai's Pocket TTS (mlx-audio `pocket_tts`, which also reads Gradium's
Phonon): a causal transformer over text tokens and a voice prompt that samples one
continuous audio latent per frame (12.5 frames a second) through a small flow network,
and Mimi's streaming decoder (a transformer and a SEANet of convolutions) that turns each
latent into 1920 samples of 24 kHz audio. Why this family, of the ~45 in mlx-audio:

- it is plain MLX at any size, and its tokenizer may be any `tokenizers` tokenizer.json:
  no grapheme-to-phoneme step (Kokoro, Kitten and MeloTTS need espeak, misaki or g2p_en),
  no codec fetched from the hub at import (the Orpheus-style `llama` loads SNAC so);
- its voices are files: `voices/<name>.safetensors`, each a voice prompt (`emb`, shape
  [1, T, d_model]) the transformer reads before the text. The model lists them, picks
  one by name, and, having no audio encoder (so no voice cloning), refuses an unknown
  name with a ValueError that lists the voices;
- it streams: one frame of audio per step, `generate(stream=True)` yields pieces.

Files: config.json (Pocket TTS's flat config, `model_type: pocket_tts`, no encoder),
model.safetensors (float32), the tokenizer (tokenizer.json and friends: the byte-level BPE
of worker/demos/text.py; the config's `n_bins` is its vocabulary size), voices/*.safetensors,
and the MARKER with meta (preset, family, seed, sample_rate, voices).
`mlx_audio.tts.utils.load_model(Path(dir))` reads config.json, builds `pocket_tts.Model`
with `model_path` set to the directory (so the tokenizer is the local tokenizer.json),
loads model.safetensors (the voices, in a subfolder, are not weights) and, since no
encoder weights are there, drops the encoder; `generate(text, voice=...)` reads
`voices/<voice>.safetensors`. Nothing touches the network.

Random weights are tuned in three ways that matter: the end-of-speech head never fires
(as worker/demos/text.py zeroes EOS), so an utterance lasts what the family allows a text at
most, (words + 2) seconds per chunk of sentences, a length known in advance that grows
with the text; the flow network's condition is scaled up, so the voice and the text
change the audio (at init the sampling noise drowns them); and the codec's convolutions
are rescaled (their init shrinks the signal 10-50x per layer) and its output set to an
RMS of about 0.1, so the audio is audible noise rather than 1e-10.

`small` (the benchmark's) is larger where the engine should dominate: ~29M parameters, a
6-layer transformer of width 512, and a codec whose convolutions run at 24 kHz; about
0.5 s of compute per second of audio on this 2-core CPU, against ~0.05 for `tiny`.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from worker.demos.text import CHATML, MARKER, _train_tokenizer, save_model_dir

FAMILY = "pocket_tts"
SAMPLE_RATE = 24000
FRAME_RATE = 12.5  # latents a second: each decodes to SAMPLE_RATE / FRAME_RATE samples
VOICES = ("ash", "birch", "cedar")  # not Pocket TTS's own names, which it would download
VOICE_FRAMES = 4  # voice prompt length, in transformer positions
TARGET_RMS = 0.1

SIZES = {
    "tiny": dict(d_model=32, heads=2, layers=1, flow_dim=32, flow_depth=1, latent=8,
                 codec_dim=32, filters=4, codec_layers=1, codec_ff=64, vocab=512),
    "small": dict(d_model=512, heads=8, layers=6, flow_dim=512, flow_depth=4, latent=32,
                  codec_dim=256, filters=16, codec_layers=2, codec_ff=1024, vocab=4000),
}


@dataclass(frozen=True)
class BuiltTTSModel:
    path: Path
    sample_rate: int
    voices: tuple[str, ...]


def _config(s: dict, n_bins: int) -> dict:
    """Pocket TTS's flat config (the form of the hub's checkpoints) at size `s`."""
    return {
        "model_type": FAMILY,
        "flow_lm": {"dtype": "float32", "d_model": s["d_model"], "num_heads": s["heads"],
                    "num_layers": s["layers"], "dim_feedforward": 4 * s["d_model"],
                    "max_period": 10000, "n_bins": n_bins, "lut_dim": s["d_model"],
                    "flow_dim": s["flow_dim"], "flow_depth": s["flow_depth"],
                    "ldim": s["latent"]},
        "mimi": {"dtype": "float32", "channels": 1, "sample_rate": SAMPLE_RATE,
                 "frame_rate": FRAME_RATE, "dimension": s["codec_dim"],
                 "quantizer_dimension": s["latent"],
                 "quantizer_output_dimension": s["codec_dim"],
                 # Mimi's strides: 24000 / 960 = 25 Hz, upsampled 2x from 12.5 Hz.
                 "n_filters": s["filters"], "n_residual_layers": 1, "ratios": [8, 6, 5, 4],
                 "kernel_size": 7, "last_kernel_size": 3, "residual_kernel_size": 3,
                 "dilation_base": 2, "compress": 2, "pad_mode": "constant",
                 "transformer_d_model": s["codec_dim"], "transformer_num_heads": s["heads"],
                 "transformer_num_layers": s["codec_layers"],
                 "transformer_layer_scale": 0.01, "transformer_context": 250,
                 "transformer_max_period": 10000, "transformer_dim_feedforward": s["codec_ff"],
                 "encoder_enabled": False},
        "temp": 0.7, "lsd_decode_steps": 1, "eos_threshold": -4.0,
    }


def build_tts_model(path: str | Path, size: str = "tiny", *, seed: int = 0) -> BuiltTTSModel:
    """Build the speech model of `size` at `path` (atomically; reused if already there)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.pocket_tts import Model, ModelConfig
    from mlx_audio.tts.models.pocket_tts.flow_lm import lsd_decode

    path = Path(path)
    if (path / MARKER).exists():
        meta = json.loads((path / MARKER).read_text())
        return BuiltTTSModel(path, meta["sample_rate"], tuple(meta["voices"]))
    s = SIZES[size]
    # The chat template is irrelevant here; the BPE is worker/demos/text.py's, and any text
    # encodes (byte-level). n_bins must equal its size, added tokens included.
    tokenizer = _train_tokenizer(s["vocab"], CHATML)
    config = _config(s, len(tokenizer))
    mx.random.seed(seed)
    with tempfile.TemporaryDirectory() as tok_dir:  # the model reads its tokenizer file
        tokenizer.save_pretrained(tok_dir)
        model = Model(ModelConfig.from_dict({**config, "model_path": tok_dir}))

    # End of speech never fires: its logit stays far below the threshold (-4).
    eos = model.flow_lm.out_eos
    eos.weight = mx.zeros_like(eos.weight)
    eos.bias = mx.full(eos.bias.shape, -100.0)
    # The voice and the text reach the audio through the flow network's condition; at
    # its init the sampling noise drowns them (two voices' audio differed by ~1%). Scaled
    # up, the condition drives the network, and its output outweighs the noise.
    flow = model.flow_lm.flow_net
    flow.cond_embed.weight = flow.cond_embed.weight * 8
    flow.final_layer.linear.weight = flow.final_layer.linear.weight * 4
    flow.final_layer.linear.bias = flow.final_layer.linear.bias * 4
    # The codec's init (uniform ±1/fan_in) shrinks the signal at every convolution:
    # rescale each to a unit-gain init (std 1/sqrt(fan_in)).
    convs = {k: w * (1 / math.sqrt(math.prod(w.shape[1:])) / mx.std(w))
             for k, w in tree_flatten(model.mimi.parameters())
             if k.endswith("weight") and w.ndim == 3}
    model.load_weights([(f"mimi.{k}", w) for k, w in convs.items()], strict=False)
    # Then set the output's level from a decode of latents as the flow network makes
    # them (its output at random noise), so the audio is neither silent nor clipped.
    cond = mx.random.normal((50, s["d_model"]))  # 50 frames: 4 s of audio
    noise = mx.random.normal((50, s["latent"])) * math.sqrt(config["temp"])
    latents = lsd_decode(partial(model.flow_lm.flow_net, cond), noise, 1)
    audio = model.mimi.decode_from_latent(model.mimi.quantizer(latents.T[None]))
    gain = TARGET_RMS / mx.sqrt(mx.mean(audio * audio)).item()
    final = model.mimi.decoder.final_conv1d.conv.conv
    model.load_weights([("mimi.decoder.final_conv1d.conv.conv.weight", final.weight * gain),
                        ("mimi.decoder.final_conv1d.conv.conv.bias", final.bias * gain)],
                       strict=False)
    weights = dict(tree_flatten(model.parameters()))
    # A voice is a prompt of random embeddings that the transformer reads before the text.
    voices = {name: mx.random.normal((1, VOICE_FRAMES, s["d_model"])) for name in VOICES}
    mx.eval(weights, voices)

    def voice_files(folder: Path) -> None:
        (folder / "voices").mkdir()
        for name, emb in voices.items():
            mx.save_safetensors(str(folder / "voices" / f"{name}.safetensors"), {"emb": emb})

    save_model_dir(path, weights, config, tokenizer,
                   {"preset": f"{size}-tts", "family": FAMILY, "seed": seed,
                    "sample_rate": SAMPLE_RATE, "voices": list(VOICES)},
                   extra=voice_files)
    return BuiltTTSModel(path, SAMPLE_RATE, VOICES)
