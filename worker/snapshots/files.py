"""KV snapshot files: one safetensors file per snapshot, checksummed.

The layout inside is mlx-lm's prompt-cache file (`save_prompt_cache`: the flattened
`state` of each layer's cache, the cache classes and scalar markers in the metadata), so
`mlx_lm.models.cache.load_prompt_cache` reads an mlxd snapshot too. mlxd adds, in the
metadata (as the fields of mlx-lm's own metadata dict, `mlxd_*`): the snapshot's name,
the tokens its state holds (packed uint32, base64) and a SHA-256 over those tokens and
every tensor's bytes. A file whose header does not parse,
whose size disagrees with its header or whose checksum fails is corrupt: the caller
deletes it, never loads it.

The work is split by thread, because only the MLX thread may touch MLX and disk time must
not stall a batch step:
- `encode` (MLX thread): flatten the cache and take host views of its evaluated arrays
  (no copy on unified memory);
- `write` (the disk tier's writer thread): hash, then write to a temporary file (mode
  0600) renamed into place, so a reader never sees half a file under the final name;
- `read` (the preparation thread): the whole file into host memory, verified;
- `decode` (MLX thread): MLX arrays and the cache objects, as `load_prompt_cache` does.

mlxd writes this format itself rather than through `mx.save_safetensors` for the
threading above; safetensors is a documented, simple format (an 8-byte header length, a
JSON header, the raw tensors).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "mlxd-kv-1"
_LEN = struct.Struct("<Q")
_MAX_HEADER = 64 << 20  # a header this large is not one of ours
# mlxd's fields in the file's metadata: keys of mlx-lm's metadata dict (element 0 of the
# flattened [metadata, classes, scalars]), so load_prompt_cache returns them as metadata.
_FORMAT, _NAME, _TOKENS, _SHA256 = "0.mlxd_format", "0.mlxd_name", "0.mlxd_tokens", "0.mlxd_sha256"

# safetensors dtype names ↔ numpy dtypes of the host bytes. bfloat16 has no numpy dtype:
# its bytes travel as uint16 and are viewed back on the MLX side.
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}


class CorruptFile(Exception):
    """A snapshot file that must not be loaded (and is deleted)."""


@dataclass
class Encoded:
    """A snapshot ready to be written: host views of its arrays (which keep the MLX arrays
    they view alive until written)."""
    name: str
    tokens: list[int]
    tensors: list[tuple[str, str, tuple, memoryview]]   # (key, dtype, shape, bytes)
    metadata: dict[str, str]                            # mlx-lm's cache metadata, flat

    @property
    def nbytes(self) -> int:
        return sum(t[3].nbytes for t in self.tensors)


@dataclass
class Snapshot:
    """A snapshot file read and verified: host arrays, not MLX ones yet."""
    name: str
    tokens: list[int]
    arrays: dict[str, tuple[str, np.ndarray]]           # key → (dtype, array)
    metadata: dict[str, str]
    nbytes: int                                         # the file's size


@dataclass
class Info:
    """What a file's header says (no tensor read)."""
    name: str
    tokens: int
    nbytes: int


# ---- MLX thread ----------------------------------------------------------------------

def encode(name: str, tokens: list[int], cache: list) -> Encoded:
    """The snapshot of `cache` (holding `tokens`), as mlx-lm's save_prompt_cache lays it
    out. MLX thread."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    scalars: list = [""]  # as mlx-lm: non-empty, or tree_flatten drops it

    def as_array(key, value):
        if isinstance(value, mx.array):
            return value
        if isinstance(value, (bool, int, float)):
            scalars.append((key, "scalar"))
            return mx.array(value)
        if isinstance(value, str):
            scalars.append((key, "string"))
            return mx.array([ord(ch) for ch in value])
        if value is None:
            scalars.append((key, "none"))
            return mx.array([])
        raise ValueError(f"a cache state holds a {type(value).__name__}")

    arrays = {k: mx.contiguous(as_array(k, v)) for k, v in tree_flatten([c.state for c in cache])}
    mx.eval(list(arrays.values()))
    tensors = []
    for key, a in arrays.items():
        dtype = _dtype_name(a.dtype)
        host = a.view(mx.uint16) if dtype == "BF16" else a
        tensors.append((key, dtype, tuple(a.shape), memoryview(host).cast("B")))
    metadata = dict(tree_flatten([{}, [type(c).__name__ for c in cache], scalars]))
    return Encoded(name, list(tokens), tensors, metadata)


def decode(snap: Snapshot) -> list:
    """The cache objects of a verified snapshot, as mlx-lm's load_prompt_cache builds
    them. MLX thread."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.models import cache as cache_mod

    arrays = {}
    for key, (dtype, host) in snap.arrays.items():
        a = mx.array(host)
        arrays[key] = a.view(mx.bfloat16) if dtype == "BF16" else a
    meta, classes, scalars = tree_unflatten(list(snap.metadata.items()))
    for key, kind in scalars[1:]:
        if kind == "scalar":
            arrays[key] = arrays[key].item()
        elif kind == "string":
            arrays[key] = "".join(chr(i) for i in arrays[key].tolist())
        elif kind == "none":
            arrays[key] = None
        else:
            raise CorruptFile(f"unknown scalar kind {kind!r}")
    states = tree_unflatten(list(arrays.items()))
    out = []
    for name, state in zip(classes, states):
        cls = getattr(cache_mod, name, None)
        if not isinstance(cls, type) or not hasattr(cls, "from_state"):
            raise CorruptFile(f"unknown cache class {name!r}")
        out.append(cls.from_state(state))
    mx.eval([c.state for c in out])
    return out


def _dtype_name(dtype) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    table = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
             "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
    if name not in table:
        raise ValueError(f"a cache array of type {name} cannot be saved")
    return table[name]


# ---- any thread (no MLX) -------------------------------------------------------------

def _digest(token_bytes: bytes, buffers) -> str:
    h = hashlib.sha256(token_bytes)
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()


def write(enc: Encoded, path: Path) -> int:
    """Write `enc` to `path` (mode 0600, atomically by rename). Returns the file's size."""
    token_bytes = np.asarray(enc.tokens, dtype="<u4").tobytes()
    header: dict = {}
    offset = 0
    for key, dtype, shape, buf in enc.tensors:
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + buf.nbytes]}
        offset += buf.nbytes
    header["__metadata__"] = {
        **enc.metadata, _FORMAT: FORMAT, _NAME: enc.name,
        _TOKENS: base64.b64encode(token_bytes).decode("ascii"),
        _SHA256: _digest(token_bytes, (t[3] for t in enc.tensors)),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_LEN.pack(len(head)))
            f.write(head)
            for t in enc.tensors:
                f.write(t[3])
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(head) + offset


def _header(f, size: int) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise CorruptFile("shorter than a header")
    (n,) = _LEN.unpack(raw)
    if n > min(_MAX_HEADER, size - 8):
        raise CorruptFile("header length past the end of the file")
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise CorruptFile("header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get(_FORMAT) != FORMAT:
        raise CorruptFile("not an mlxd snapshot")
    return header, 8 + n


def _tokens(meta: dict) -> bytes:
    try:
        raw = base64.b64decode(meta[_TOKENS], validate=True)
    except (KeyError, ValueError):
        raise CorruptFile("no token list") from None
    if len(raw) % 4:
        raise CorruptFile("token list is cut")
    return raw


def read_info(path: Path) -> Info:
    """The name, token count and size of a snapshot file, from its header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, _ = _header(f, size)
    meta = header["__metadata__"]
    return Info(str(meta.get(_NAME, "")), len(_tokens(meta)) // 4, size)


def read(path: Path) -> Snapshot:
    """A snapshot file, whole and verified. Raises CorruptFile (or OSError)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, start = _header(f, size)
        data = f.read()
    meta = header.pop("__metadata__")
    token_bytes = _tokens(meta)
    arrays, buffers, end = {}, [], 0
    try:
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for key, spec in entries:
            a, b = spec["data_offsets"]
            dtype = spec["dtype"]
            if a != end or b < a or b > len(data) or dtype not in _NUMPY:
                raise CorruptFile(f"tensor {key!r} does not fit the file")
            buf = data[a:b]
            host = np.frombuffer(buf, dtype=_NUMPY[dtype]).reshape(spec["shape"])
            arrays[key] = (dtype, host)
            buffers.append(buf)
            end = b
    except (KeyError, TypeError, ValueError):
        raise CorruptFile("tensor table is malformed") from None
    if start + end != size:
        raise CorruptFile(f"{size - start - end} bytes more or less than the header says")
    if _digest(token_bytes, buffers) != meta.get(_SHA256):
        raise CorruptFile("checksum mismatch")
    tokens = np.frombuffer(token_bytes, dtype="<u4").tolist()
    return Snapshot(str(meta.get(_NAME, "")), tokens, arrays, meta, size)
