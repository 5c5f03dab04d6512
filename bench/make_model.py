"""Build a benchmark model (random weights, float32, no download).

    python -m bench.make_model --preset tiny|small [--out DIR]

Presets: `tiny` (hidden 64, 2 layers: server overhead dominates) and `small` (qwen2-type,
hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1536, vocab 8000, ~28M parameters:
the engine dominates). Prints the model directory. Any local model path can be benchmarked
instead (pass it to the benchmarks' --model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.demo import PRESETS, build_model

MODELS_DIR = Path(__file__).resolve().parent / "models"


def model_path(preset: str | None, model: str | None) -> Path:
    """The preset's model (built on first use) or the given path."""
    if model:
        return Path(model)
    return build_model(MODELS_DIR / preset, preset).path


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.make_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(k for k in PRESETS if k != "demo"), default="tiny")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    path = build_model(args.out or MODELS_DIR / args.preset, args.preset).path
    print(path)


if __name__ == "__main__":
    main()
