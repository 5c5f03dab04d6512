"""mlxd against raw in-process mlx-vlm: an image request's time to first token, one run.

    python -m bench.multimodal [--size small|tiny] [--model PATH] [--rounds 5]

The model: a random-weight Qwen2-VL built locally (worker/demo_vision.py; `small`: hidden
512, 8 layers, a 4-layer vision tower, 448×448 images = 256 image tokens), or any local
mlx-vlm model. The request: a short question about one 448×448 PNG, streamed, greedy.
Raw: `mlx_vlm.stream_generate` in this process on the same prompt and image (its image
processing included, as mlxd's is). mlxd: `/v1/chat/completions` with the image as a
data: URL (decoding, processing, prefill and the first token, plus HTTP). Rounds alternate
raw and mlxd (drift hits both), a first round compiles and is not counted; medians.
Goal (issue "Vision and audio"): mlxd TTFT ÷ raw TTFT <= 1.05. Speech (transcription
and synthesis) rows come with the speech engines.
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


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multimodal", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--model", default=None, help="a local mlx-vlm model directory instead")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from mlx_vlm import load

    from worker.demo_vision import build_vision_model

    path = Path(args.model) if args.model else build_vision_model(
        MODELS_DIR / f"{args.size}-vision", args.size).path
    model, processor = load(str(path))
    pngs = [image_png(seed=i) for i in range(args.rounds + 1)]
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
    name = args.model or f"{args.size}-vision"
    print_table(f"python -m bench.multimodal --size {args.size} --rounds {args.rounds}", [
        (f"{name}: image request TTFT", f"raw mlx-vlm {raw * 1e3:.1f} ms, mlxd {ours * 1e3:.1f} ms"
         f" = {ratio:.3f}", goal(ratio, "<=", 1.05))])


if __name__ == "__main__":
    blas.reexec()  # the raw engine here multiplies with the BLAS the workers use
    main()
