"""mlxd against raw in-process mlx-vlm and mlx-audio: an image request's time to first
token, a transcription's real-time factor, a synthesis' time; one run.

    python -m bench.multimodal [--size small|tiny] [--model PATH] [--rounds 5]
                               [--only vision|speech]

The model: a random-weight Qwen2-VL built locally (worker/demos/vision.py; `small`: hidden
512, 8 layers, a 4-layer vision tower, 448×448 images = 256 image tokens), or any local
mlx-vlm model. The request: a short question about one 448×448 PNG, streamed, greedy.
Raw: `mlx_vlm.stream_generate` in this process on the same prompt and image (its image
processing included, as mlxd's is). mlxd: `/v1/chat/completions` with the image as a
data: URL (decoding, processing, prefill and the first token, plus HTTP). Rounds alternate
raw and mlxd (drift hits both), a first round compiles and is not counted; medians.
Goal (issue "Vision and audio"): mlxd TTFT ÷ raw TTFT <= 1.05.

Speech, the same way (models of worker/demos/stt.py and worker/demos/tts.py at `--size`):
transcription of a 30-s WAV, raw `model.generate(path)` in this process (mlx-audio's own
decoding included; float32 on the CPU as the worker runs it: worker/speech/transcriber.py)
vs `/v1/audio/transcriptions` with the file; synthesis of a sentence, raw iterating
`model.generate(text, voice)` reading each piece's audio vs `/v1/audio/speech` (pcm: no encoder in the way) read to
the end. Goals: transcription real-time factor ÷ raw <= 1.05; synthesis time ÷ raw <= 1.05.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from pathlib import Path

from bench.make_model import MODELS_DIR
from bench.report import goal, print_table
from bench.serverproc import ServerProcess
from bench.throughput import stream_chat
from supervisor.workers import blas

QUESTION = "What is in the picture?"


def image_png(size: int = 448, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def raw_ttft(model, processor, png: bytes) -> float:
    from mlx_vlm import stream_generate
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image"}]}]
    t0 = time.perf_counter()
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
    for _ in stream_generate(model, processor, text, image=[Image.open(io.BytesIO(png))],
                             max_tokens=1, temperature=0.0):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


def server_ttft(port: int, model: str, png: bytes) -> float:
    """One token asked for: it has come when the choice finishes."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return stream_chat(port, {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     {"type": "image_url", "image_url": {"url": url}}]}]})["finish"]


SENTENCE = "Hello there, this is a test."


def speech_rows(size: str, rounds: int) -> list[tuple[str, str, str]]:
    import tempfile

    import httpx
    import mlx.core as mx
    import numpy as np
    from mlx_audio.stt.utils import load_model as load_stt
    from mlx_audio.tts.utils import load_model as load_tts

    from worker.demos.stt import build_stt_model
    from worker.demos.tts import build_tts_model
    from worker.speech.transcriber import _float32_on_cpu

    stt = build_stt_model(MODELS_DIR / f"{size}-stt", size).path
    tts = build_tts_model(MODELS_DIR / f"{size}-tts", size).path
    whisper = load_stt(str(stt))
    fp32 = _float32_on_cpu(whisper)
    voice_model = load_tts(tts)
    seconds = 30.0
    wav = Path(tempfile.mkdtemp()) / "clip.wav"
    wav.write_bytes(tone_wav(seconds))
    stt_pairs, tts_pairs = [], []
    with ServerProcess([str(stt), str(tts)]) as srv, httpx.Client(timeout=600) as http:
        srv.wait_healthy(timeout=300)
        for i in range(rounds + 1):  # round 0 compiles: not counted
            t0 = time.perf_counter()
            whisper.generate(str(wav), language="en", verbose=None,
                             **({"fp16": False} if fp32 else {}))
            raw = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = http.post(f"{srv.url}/v1/audio/transcriptions", files={
                "file": ("clip.wav", wav.read_bytes())}, data={"model": str(stt),
                                                               "language": "en"})
            ours = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            t0 = time.perf_counter()
            for result in voice_model.generate(SENTENCE, voice="ash"):
                # The audio as a caller gets it: an MLX array is lazy, and left unread
                # the codec would never run (raw would time the transformer alone).
                np.asarray(result.audio)
            raw_tts = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = http.post(f"{srv.url}/v1/audio/speech", json={
                "model": str(tts), "input": SENTENCE, "voice": "ash",
                "response_format": "pcm"})
            ours_tts = time.perf_counter() - t0
            assert r.status_code == 200 and r.content, r.text
            if i:
                stt_pairs.append((raw / seconds, ours / seconds))
                tts_pairs.append((raw_tts, ours_tts))
            mx.clear_cache()
    raw_rtf, our_rtf = (statistics.median(p[k] for p in stt_pairs) for k in (0, 1))
    raw_t, our_t = (statistics.median(p[k] for p in tts_pairs) for k in (0, 1))
    return [
        (f"{size}-stt: transcription RTF (30 s WAV)",
         f"raw mlx-audio {raw_rtf:.4f}, mlxd {our_rtf:.4f} = {our_rtf / raw_rtf:.3f}",
         goal(our_rtf / raw_rtf, "<=", 1.05)),
        (f"{size}-tts: synthesis time ({len(SENTENCE.split())} words)",
         f"raw mlx-audio {raw_t * 1e3:.0f} ms, mlxd {our_t * 1e3:.0f} ms = {our_t / raw_t:.3f}",
         goal(our_t / raw_t, "<=", 1.05)),
    ]


def tone_wav(seconds: float, rate: int = 16000) -> bytes:
    """A real WAV file: a 300 Hz tone wobbling 3 times a second (also the speech tests')."""
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 300 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def vision_rows(size: str, model_path: str | None, rounds: int) -> list[tuple[str, str, str]]:
    from mlx_vlm import load

    from worker.demos.vision import build_vision_model

    path = Path(model_path) if model_path else build_vision_model(
        MODELS_DIR / f"{size}-vision", size).path
    model, processor = load(str(path))
    pngs = [image_png(seed=i) for i in range(rounds + 1)]
    pairs = []
    with ServerProcess([str(path)]) as srv:
        srv.wait_healthy(timeout=300)
        for i, png in enumerate(pngs):  # round 0 compiles: not counted
            pair = (raw_ttft(model, processor, png), server_ttft(srv.port, str(path), png))
            if i:
                pairs.append(pair)
    raw = statistics.median(r for r, _ in pairs)
    ours = statistics.median(s for _, s in pairs)
    ratio = ours / raw
    name = model_path or f"{size}-vision"
    return [(f"{name}: image request TTFT", f"raw mlx-vlm {raw * 1e3:.1f} ms, mlxd "
             f"{ours * 1e3:.1f} ms = {ratio:.3f}", goal(ratio, "<=", 1.05))]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multimodal", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--model", default=None, help="a local mlx-vlm model directory instead")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", choices=["vision", "speech"], default=None)
    args = p.parse_args()
    rows = []
    if args.only in (None, "vision"):
        rows += vision_rows(args.size, args.model, args.rounds)
    if args.only in (None, "speech"):
        rows += speech_rows(args.size, args.rounds)
    print_table(f"python -m bench.multimodal --size {args.size} --rounds {args.rounds}"
                + (f" --only {args.only}" if args.only else ""), rows)


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
