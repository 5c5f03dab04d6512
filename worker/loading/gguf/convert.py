"""Convert a GGUF into an mlx-lm model directory, once per file and options.

Why convert instead of reading GGUF at load: mlx-lm loads safetensors with the Hugging
Face names and layouts, a tokenizer.json and a config.json, and every other part of the
worker (templates, tool parsers, the prefix cache, the memory gate's size on disk) already
works on such a directory. So a GGUF is dequantized (`gguf` package: legacy and K-quants)
and written once, in the precision chosen for the backend (float32 on MLX's CPU backend,
which runs it far faster than half precision; bfloat16 on a GPU) or re-quantized to MLX's
own 4 or 8 bits; later loads find the directory by the file's SHA-256 and skip the work.

A directory counts as converted only when its marker (MARKER) names this converter's
VERSION, the source hash and the options: it is written last, after the result loaded
in mlx-lm, and the directory is moved into place whole, so a crash mid-way or two
workers converting at once leave either nothing or a complete directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from protocol.models import GGUF_HASHES, file_stamp
from worker.loading.gguf.families import SKIPPED, config_for, family
from worker.loading.gguf.tokenizer import build as build_tokenizer
from worker.loading.gguf.tokenizer import eos_token_ids
from worker.loading.gguf.reader import GGUFError, GGUFFile

log = logging.getLogger("worker.loading.gguf")

VERSION = 1                    # bump when a conversion's output changes
MARKER = "mlxd-gguf.json"
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE = ("none", "4", "8")
GROUP_SIZE = 64                # MLX's default quantization group

Progress = Callable[[int, int], None]   # (tensors done, tensors in all)


@dataclass(frozen=True)
class Options:
    dtype: str = "auto"        # one of DTYPES
    quantize: str = "none"     # one of QUANTIZE: MLX bits to re-quantize to

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise GGUFError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantize not in QUANTIZE:
            raise GGUFError(f"quantize {self.quantize!r} is not one of {', '.join(QUANTIZE)}")

    def resolved(self) -> "Options":
        """`auto` made concrete for this process's MLX backend."""
        if self.dtype != "auto":
            return self
        import mlx.core as mx

        cpu = mx.default_device() == mx.cpu
        return Options("float32" if cpu else "bfloat16", self.quantize)

    @property
    def key(self) -> str:
        return self.dtype + ("" if self.quantize == "none" else f"-q{self.quantize}")


def sha256(path: Path, memo_dir: Path | None = None) -> str:
    """The file's SHA-256; remembered in `memo_dir` by real path, size, mtime and inode,
    so a 40 GB file is hashed once, not at every start (the supervisor reads the same
    record to find a file's conversions: protocol/models.py)."""
    path = Path(os.path.realpath(path))
    stamp = file_stamp(path)
    memo = memo_dir / GGUF_HASHES if memo_dir else None
    known = _read_json(memo) if memo else {}
    entry = known.get(str(path))
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    if memo:
        known = _read_json(memo)  # again: another worker may have added to it meanwhile
        known[str(path)] = {"stamp": stamp, "sha256": digest}
        _write_atomic(memo, json.dumps(known, indent=1))
    return digest


def cache_dir(gguf_root: Path, digest: str, options: Options) -> Path:
    """Where a file's conversion with `options` (resolved) lives."""
    return Path(gguf_root) / f"{digest[:16]}-{options.key}"


def is_converted(out: Path, digest: str, options: Options) -> bool:
    meta = _read_json(Path(out) / MARKER)
    return (meta.get("version") == VERSION and meta.get("sha256") == digest
            and meta.get("options") == [options.dtype, options.quantize])


def ensure(source: Path, out: Path, options: Options, *, memo_dir: Path | None = None,
           progress: Progress | None = None) -> Path:
    """`out` holding `source` converted with `options`: converted now unless it already
    is. Raises GGUFError for a file that cannot be converted."""
    options = options.resolved()
    digest = sha256(source, memo_dir)
    out = Path(out)
    if is_converted(out, digest, options):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
    try:
        info = convert(Path(source), tmp, options, progress)
        info.update(version=VERSION, sha256=digest, options=[options.dtype, options.quantize],
                    source=str(source))
        (tmp / MARKER).write_text(json.dumps(info, indent=2))
        _replace(tmp, out, lambda: is_converted(out, digest, options))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(source: Path, out: Path, options: Options, progress: Progress | None = None) -> dict:
    """Write the mlx-lm directory for `source` into the (empty) directory `out`; returns
    what the marker records about the source."""
    import mlx.core as mx

    g = GGUFFile(source)
    fam = family(g)            # unknown architecture: fail before any work
    g.check_quant_types()
    tok = build_tokenizer(g)
    vocab_size = max(len(g.get("tokenizer.ggml.tokens")), _rows(g, "token_embd.weight"))
    config = config_for(g, vocab_size)
    eos = eos_token_ids(g)
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    dtype = getattr(mx, options.dtype)

    weights = {}
    names = sorted(g.tensors)
    for i, name in enumerate(names):
        hf = fam.hf_name(name)
        if hf is None:
            if name in SKIPPED:
                continue
            raise GGUFError(f"{source.name}: tensor {name} has no place in a {g.arch} model")
        values = fam.transform(name, g.tensor(name), config)
        weights[hf] = mx.array(values).astype(dtype)
        mx.eval(weights[hf])            # one tensor at a time: peak memory stays low
        if progress:
            progress(i + 1, len(names))
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)

    _save_weights(out, weights)
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(str(out))
    _check_and_quantize(out, options)
    return {"architecture": g.arch, "quant_types": sorted(g.quant_types()),
            "name": g.get("general.name")}


def _rows(g: GGUFFile, name: str) -> int:
    t = g.tensors.get(name)
    return int(t.shape[-1]) if t is not None else 0


def _save_weights(out: Path, weights: dict) -> None:
    """As mlx-lm saves a model: shards of at most 5 GB, an index, format "mlx"."""
    import mlx.core as mx
    from mlx_lm.utils import make_shards

    shards = make_shards(weights)
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {}}
    for i, shard in enumerate(shards):
        name = pattern.format(i + 1, len(shards))
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _check_and_quantize(out: Path, options: Options) -> None:
    """Load the result as mlx-lm will (strict: every weight in place, none left over),
    and re-quantize it to MLX's own format if asked."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    try:
        model, config = load_model(out, lazy=True, strict=True)
    except Exception as e:  # a family whose tensors do not fit mlx-lm's model
        raise GGUFError(f"the converted model does not load in mlx-lm: {type(e).__name__}: "
                        f"{e}"[:500]) from None
    if options.quantize == "none":
        return
    model, config = quantize_model(model, config, GROUP_SIZE, int(options.quantize))
    staged = out / ".quantized"
    save_model(staged, model)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    for new in staged.iterdir():
        new.rename(out / new.name)
    staged.rmdir()
    save_config(config, out / "config.json")


def _replace(tmp: Path, out: Path, done_by_other: Callable[[], bool]) -> None:
    """Move `tmp` to `out`, replacing a stale `out` (an older conversion, a random-weight
    demo of an older mlxd) unless another process put a good one there meanwhile."""
    try:
        os.rename(tmp, out)
        return
    except OSError:
        if done_by_other():
            return
    stale = out.with_name(f".{out.name}.{os.getpid()}.stale")
    os.rename(out, stale)
    os.rename(tmp, out)
    shutil.rmtree(stale, ignore_errors=True)


def _remove_abandoned(out: Path) -> None:
    """Remove what conversions into `out` by dead processes left (a worker killed while
    converting: SIGKILL, or SIGTERM during a load, which exits at once). A live one's
    directory stays: it may be converting the same file right now."""
    for tmp in out.parent.glob(f".{out.name}.*.*"):
        pid = tmp.name[len(out.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
