"""KV snapshot files: one safetensors file per snapshot, checksummed whole.

The layout inside is mlx-lm's prompt-cache file (`save_prompt_cache`: the flattened
`state` of each layer's cache, the cache classes and scalar markers in the metadata), so
`mlx_lm.models.cache.load_prompt_cache` reads an mlxd snapshot too. mlxd adds, in the
metadata (as the fields of mlx-lm's own metadata dict, `mlxd_*`): the snapshot's name,
the model identity it was computed by (worker/kvcache/identity.py), the tokens its
state holds (packed uint32, base64) and a SHA-256 over the whole file but the digest
itself. Everything that decides what is loaded is in the header (the tensor table's
names, dtypes, shapes and offsets, the cache classes, the name, identity and tokens), so
the checksum covers the header bytes as well as the data: a file whose tensor table was
edited (two offsets swapped, the data untouched) fails it like a flipped data byte. The
digest sits at a fixed place (the header opens with the metadata, the metadata with the
digest), so `read` checks it before it parses anything; a file that fails, or whose size
disagrees with its header, is corrupt: the caller deletes it, never loads it. A file of an
older format (another `FORMAT`) is refused the same way: a cache miss, never a load.

The MTP head's state beside the model's (worker/kvcache/prefix.py `head`) rides in the
same file, in the same format: its layers' states follow the model's in the tensors
(layer indices past the model's), their classes in mlxd's own metadata field
(`mlxd_head`), not in the classes list. So readers that zip the classes with the states
(mlx-lm's load_prompt_cache, and mlxd before the head was kept) load the model's layers
and ignore the head's: no new format, and no file of the old one is lost.

The work is split by thread, because only the MLX thread may touch MLX and disk time must
not stall a batch step:
- `encode` (MLX thread): flatten the cache and take host views of its evaluated arrays
  (no copy on unified memory);
- `write` (the disk tier's writer thread): hash, then write to a temporary file (mode
  0600) renamed into place, so a reader never sees half a file under the final name;
- `read` (the preparation thread): the whole file into host memory, verified, parsed;
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

FORMAT = "mlxd-kv-2"  # 2: the checksum covers the header (1: only tokens and data)
_LEN = struct.Struct("<Q")
_MAX_HEADER = 64 << 20  # a header this large is not one of ours
# mlxd's fields in the file's metadata: keys of mlx-lm's metadata dict (element 0 of the
# flattened [metadata, classes, scalars]), so load_prompt_cache returns them as metadata.
_FORMAT, _NAME, _TOKENS, _SHA256 = "0.mlxd_format", "0.mlxd_name", "0.mlxd_tokens", "0.mlxd_sha256"
_IDENTITY = "0.mlxd_identity"
_HEAD = "0.mlxd_head"  # the MTP head's layer classes, comma-separated (absent: none)
# Every header opens with these bytes, then the 64 hex digits of the digest: the digest is
# found (and checked) without parsing the header.
_LEAD = b'{"__metadata__":{"' + _SHA256.encode() + b'":"'
_AT = _LEN.size + len(_LEAD)  # the digest's offset in the file
_HEX = 64

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
    identity: str                                       # the model identity it claims
    tokens: list[int]
    arrays: dict[str, tuple[str, np.ndarray]]           # key → (dtype, array)
    metadata: dict[str, str]
    nbytes: int                                         # the file's size


@dataclass
class Info:
    """What a file's header says (no tensor read, nothing verified)."""
    name: str
    identity: str
    tokens: int
    nbytes: int


# ---- MLX thread ----------------------------------------------------------------------

def encode(name: str, tokens: list[int], cache: list, head: list | None = None) -> Encoded:
    """The snapshot of `cache` (holding `tokens`), as mlx-lm's save_prompt_cache lays it
    out, and the MTP head's state beside it (`head`: module doc). MLX thread."""
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

    head = head or []
    arrays = {k: mx.contiguous(as_array(k, v))
              for k, v in tree_flatten([c.state for c in cache + head])}
    mx.eval(list(arrays.values()))
    tensors = []
    for key, a in arrays.items():
        dtype = _dtype_name(a.dtype)
        host = a.view(mx.uint16) if dtype == "BF16" else a
        tensors.append((key, dtype, tuple(a.shape), memoryview(host).cast("B")))
    metadata = dict(tree_flatten([{}, [type(c).__name__ for c in cache], scalars]))
    if head:
        metadata[_HEAD] = ",".join(type(c).__name__ for c in head)
    return Encoded(name, list(tokens), tensors, metadata)


def decode(snap: Snapshot) -> list:
    """The cache objects of a verified snapshot, as mlx-lm's load_prompt_cache builds
    them. MLX thread."""
    return decode_all(snap)[0]


def decode_all(snap: Snapshot) -> tuple[list, list | None]:
    """(the cache objects of a verified snapshot, the MTP head's state beside them or
    None). MLX thread."""
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
    head = [n for n in str(meta.get(_HEAD.split(".", 1)[1], "")).split(",") if n]
    if head and len(states) != len(classes) + len(head):
        raise CorruptFile(f"{len(states)} layer states for {len(classes) + len(head)} classes")
    out = []
    for name, state in zip(classes + head, states):
        cls = getattr(cache_mod, name, None)
        if not isinstance(cls, type) or not hasattr(cls, "from_state"):
            raise CorruptFile(f"unknown cache class {name!r}")
        out.append(cls.from_state(state))
    mx.eval([c.state for c in out])
    if not head:
        return out, None
    return out[:len(classes)], out[len(classes):]


def _dtype_name(dtype) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    table = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
             "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
             "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
    if name not in table:
        raise ValueError(f"a cache array of type {name} cannot be saved")
    return table[name]


# ---- any thread (no MLX) -------------------------------------------------------------

def _digest(pieces) -> str:
    """The checksum of a file given as pieces: all its bytes but the digest's own."""
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def write(enc: Encoded, path: Path, identity: str) -> int:
    """Write `enc`, computed by the model `identity`, to `path` (mode 0600, atomically by
    rename). Returns the file's size."""
    token_bytes = np.asarray(enc.tokens, dtype="<u4").tobytes()
    header: dict = {"__metadata__": {  # first, its digest first: where `_LEAD` says
        _SHA256: "0" * _HEX, **enc.metadata, _FORMAT: FORMAT, _NAME: enc.name,
        _IDENTITY: identity, _TOKENS: base64.b64encode(token_bytes).decode("ascii")}}
    offset = 0
    for key, dtype, shape, buf in enc.tensors:
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + buf.nbytes]}
        offset += buf.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    lead = _LEN.pack(len(head)) + head
    digest = _digest([lead[:_AT], lead[_AT + _HEX:], *(t[3] for t in enc.tensors)])
    lead = lead[:_AT] + digest.encode() + lead[_AT + _HEX:]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(lead)
            for t in enc.tensors:
                f.write(t[3])
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(lead) + offset


def _header_length(raw: bytes, size: int) -> int:
    """The length of the JSON header that `raw` (the file's first bytes) opens with."""
    if len(raw) < _AT + _HEX:
        raise CorruptFile("shorter than a header")
    (n,) = _LEN.unpack_from(raw)
    if n > min(_MAX_HEADER, size - _LEN.size):
        raise CorruptFile("header length past the end of the file")
    if n < _AT + _HEX - _LEN.size or bytes(raw[_LEN.size:_AT]) != _LEAD:
        raise CorruptFile(f"not an {FORMAT} snapshot (an older format, or not mlxd's)")
    return n


def _parse(head) -> dict:
    """The header's JSON (its `__metadata__` an mlxd snapshot's of this format)."""
    try:
        header = json.loads(bytes(head))
    except ValueError:
        raise CorruptFile("header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get(_FORMAT) != FORMAT:
        raise CorruptFile(f"not an {FORMAT} snapshot")
    return header


def _tokens(meta: dict) -> bytes:
    try:
        raw = base64.b64decode(meta[_TOKENS], validate=True)
    except (KeyError, TypeError, ValueError):
        raise CorruptFile("no token list") from None
    if len(raw) % 4:
        raise CorruptFile("token list is cut")
    return raw


def read_info(path: Path) -> Info:
    """The name, identity, token count and size a snapshot file's header claims: read
    from the header only, not verified (the disk tier indexes by it; `read` verifies)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(_AT + _HEX)
        n = _header_length(raw, size)
        meta = _parse(raw[_LEN.size:] + f.read(n + _LEN.size - len(raw)))["__metadata__"]
    return Info(str(meta.get(_NAME, "")), str(meta.get(_IDENTITY, "")),
                len(_tokens(meta)) // 4, size)


def read(path: Path) -> Snapshot:
    """A snapshot file, whole and verified (checksum first, then parsed). Raises
    CorruptFile (or OSError)."""
    raw = memoryview(path.read_bytes())
    size = len(raw)
    n = _header_length(raw, size)
    if _digest([raw[:_AT], raw[_AT + _HEX:]]).encode() != bytes(raw[_AT:_AT + _HEX]):
        raise CorruptFile("checksum mismatch")
    start = _LEN.size + n
    header = _parse(raw[_LEN.size:start])
    meta = header.pop("__metadata__")
    token_bytes = _tokens(meta)
    data = raw[start:]
    arrays, end = {}, 0
    try:
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for key, spec in entries:
            a, b = spec["data_offsets"]
            dtype = spec["dtype"]
            if a != end or b < a or b > len(data) or dtype not in _NUMPY:
                raise CorruptFile(f"tensor {key!r} does not fit the file")
            host = np.frombuffer(data[a:b], dtype=_NUMPY[dtype]).reshape(spec["shape"])
            arrays[key] = (dtype, host)
            end = b
    except (KeyError, TypeError, ValueError):
        raise CorruptFile("tensor table is malformed") from None
    if start + end != size:
        raise CorruptFile(f"{size - start - end} bytes more or less than the header says")
    tokens = np.frombuffer(token_bytes, dtype="<u4").tolist()
    return Snapshot(str(meta.get(_NAME, "")), str(meta.get(_IDENTITY, "")), tokens, arrays,
                    meta, size)
