"""KV snapshot files and the disk tier (worker/kvcache/files.py, disk.py): every cache
kind round-trips (bf16, recurrent, quantized), mlx-lm reads the files, a damaged file
(its data or anything its header says: the tensor table, the name, identity and tokens)
is deleted and counted and never loaded, as is a file of the older format or one in
another snapshot's or model's place; the byte budget drops the least recently used."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, load_prompt_cache

from worker.kvcache import files
from worker.kvcache.disk import DiskTier, _file_name
from worker.kvcache.identity import model_identity


def a_cache(tokens=7, dtype=mx.bfloat16):
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, tokens, 16)).astype(dtype),
                        mx.random.normal((1, 2, tokens, 16)).astype(dtype))
    rec = ArraysCache(2)
    rec[0], rec[1] = mx.random.normal((1, 3, 4)), mx.ones((1, 2))
    quant = QuantizedKVCache(group_size=32, bits=4)
    quant.update_and_fetch(mx.random.normal((1, 2, tokens, 64)),
                           mx.random.normal((1, 2, tokens, 64)))
    return [kv, rec, quant]


def same_state(a, b) -> bool:
    fa, fb = tree_flatten([c.state for c in a]), tree_flatten([c.state for c in b])
    return len(fa) == len(fb) and all(
        ka == kb and (mx.array_equal(va, vb).item() if isinstance(va, mx.array) else va == vb)
        for (ka, va), (kb, vb) in zip(fa, fb))


def write(tmp_path, name="resp_1", tokens=7, identity=None, **kw):
    cache = a_cache(tokens, **kw)
    path = tmp_path / _file_name(name)
    size = files.write(files.encode(name, list(range(100, 100 + tokens)), cache), path,
                       identity or tmp_path.name)  # a tier's identity: its directory's name
    return cache, path, size


def split(path) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and data."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(path, header: dict, data: bytes) -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def edit_header(path, edit) -> None:
    """Rewrite a snapshot file's JSON header through `edit(header)`, its data untouched
    (the keys stay in their order, so the stored digest stays where it was)."""
    header, data = split(path)
    edit(header)
    join(path, header, data)


def swap_offsets(header) -> None:
    """The outside tester's edit: the first two tensors (a layer's keys and values, the
    same dtype and shape) trade places."""
    a, b = [k for k in header if k != "__metadata__"][:2]
    header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                            header[a]["data_offsets"])


def test_every_cache_kind_round_trips_and_mlx_lm_reads_the_file(tmp_path):
    cache, path, size = write(tmp_path)
    assert path.stat().st_size == size
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    snap = files.read(path)
    assert snap.name == "resp_1" and snap.tokens == list(range(100, 107))
    back = files.decode(snap)
    assert [type(c) for c in back] == [KVCache, ArraysCache, QuantizedKVCache]
    assert same_state(cache, back) and back[0].offset == 7
    assert back[0].keys.dtype == mx.bfloat16
    theirs, meta = load_prompt_cache(str(path), return_metadata=True)
    assert same_state(cache, theirs) and meta["mlxd_name"] == "resp_1"
    assert files.read_info(path) == files.Info("resp_1", tmp_path.name, 7, size)
    assert snap.identity == tmp_path.name


def _meta(field, value):
    def edit(header):
        header["__metadata__"][field] = value
    return edit


def _tensor(field, change):
    def edit(header):
        spec = header["0.0"]  # the KV cache's keys: bf16 [1, 2, 7, 16]
        spec[field] = change(spec[field])
    return edit


def _rename(header):
    header["0.9"] = header.pop("0.0")


TOKENS = base64.b64encode(struct.pack("<7I", *range(200, 207))).decode()

EDITS = {
    "swap two tensors' offsets": swap_offsets,
    "change a dtype": _tensor("dtype", lambda _: "F16"),
    "change a shape": _tensor("shape", lambda s: [s[0], s[1], s[3], s[2]]),
    "rename a tensor": _rename,
    "change the name": _meta("0.mlxd_name", "resp_2"),
    "change the identity": _meta("0.mlxd_identity", "another-model"),
    "change the tokens": _meta("0.mlxd_tokens", TOKENS),
    "change a cache class": _meta("1.0", "RotatingKVCache"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_header_fails_the_checksum(tmp_path, edit):
    _, path, size = write(tmp_path)
    data = path.read_bytes()[-1000:]
    edit_header(path, EDITS[edit])
    assert path.read_bytes()[-1000:] == data  # the data untouched
    with pytest.raises(files.CorruptFile, match="checksum"):
        files.read(path)


def test_a_file_of_the_older_format_is_a_miss_never_loaded(tmp_path):
    """mlxd-kv-1: the metadata last, a checksum over the tokens and the data only."""
    d = tmp_path / "kv"
    d.mkdir()
    _, path, _ = write(d)
    header, data = split(path)
    meta = header.pop("__metadata__")
    del meta["0.mlxd_identity"]
    meta.update({"0.mlxd_format": "mlxd-kv-1", "0.mlxd_sha256": hashlib.sha256(
        base64.b64decode(meta["0.mlxd_tokens"]) + data).hexdigest()})
    join(path, {**header, "__metadata__": meta}, data)
    with pytest.raises(files.CorruptFile, match="older format"):
        files.read(path)
    tier = DiskTier(d, 1 << 30)
    tier.start()
    assert tier.corrupt == 1 and not path.exists() and tier.load("resp_1") is None


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "garble the header",
                                    "empty"])
def test_a_damaged_file_is_refused(tmp_path, damage):
    _, path, size = write(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: size - 100]
    elif damage == "garble the header":
        raw[12:20] = b"\x00" * 8
    else:
        raw = b""
    path.write_bytes(bytes(raw))
    with pytest.raises(files.CorruptFile):
        files.read(path)


def test_a_corrupt_file_is_deleted_and_counted_at_start_and_at_load(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    _, good, _ = write(d, "resp_good")
    _, bad, _ = write(d, "resp_bad")
    _, later, _ = write(d, "resp_later")
    bad.write_bytes(bad.read_bytes()[:50])          # unreadable header: found at start
    (d / ".x.123.tmp").write_bytes(b"half")          # a write cut short by a kill
    raw = bytearray(later.read_bytes())
    raw[-3] ^= 1                                    # bad data: found when read
    later.write_bytes(bytes(raw))
    tier = DiskTier(d, 1 << 30)
    tier.start()
    assert tier.corrupt == 1 and not bad.exists() and not (d / ".x.123.tmp").exists()
    assert tier.has("resp_good") and tier.has("resp_later")
    assert tier.load("resp_later") is None
    assert tier.corrupt == 2 and not later.exists() and not tier.has("resp_later")
    assert tier.load("resp_good").name == "resp_good"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_the_budget_drops_the_least_recently_used_also_after_a_restart(tmp_path):
    d = tmp_path / "kv"
    one = files.encode("x", list(range(7)), a_cache()).nbytes
    tier = DiskTier(d, int(one * 3.5))  # room for three files
    tier.start()
    clock = [1000.0]
    tier._clock = lambda: clock[0]
    for name in ("a", "b", "c"):
        assert tier.put(files.encode(name, list(range(7)), a_cache()))
        assert tier.flush()
        clock[0] += 10
    assert tier.load("a") is not None  # used: now the most recent
    os.utime(tier.entries()["b"].path, (900, 900))  # mtimes as a restart reads them
    os.utime(tier.entries()["c"].path, (950, 950))
    tier.put(files.encode("d", list(range(7)), a_cache()))
    tier.flush()
    assert set(tier.entries()) == {"a", "c", "d"} and tier.evictions == 1
    assert tier.nbytes == sum(e.nbytes for e in tier.entries().values()) <= tier.max_bytes
    tier.close()
    again = DiskTier(d, int(one * 2.5))  # a smaller budget at the next start
    again.start()
    assert set(again.entries()) == {"a", "d"}  # c's mtime (950) is the oldest


def test_a_snapshot_larger_than_the_tier_is_not_written(tmp_path):
    tier = DiskTier(tmp_path / "kv", 1000)
    tier.start()
    assert not tier.put(files.encode("big", list(range(7)), a_cache()))
    assert tier.skipped == 1 and tier.entries() == {}


def test_the_identity_changes_with_the_weights_and_the_cache_layout(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"1234")
    first = model_identity(model)
    assert model_identity(model) == first
    assert model_identity(model, max_kv_size=256) != first
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same size, rewritten
    second = model_identity(model)
    assert second != first
    weights.write_bytes(b"12345")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another size only
    assert model_identity(model) not in (first, second)


def test_a_file_in_another_snapshots_place_is_refused_at_start(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    _, path, _ = write(d, "resp_a")
    path.rename(d / _file_name("resp_b"))  # resp_a's file under resp_b's name
    tier = DiskTier(d, 1 << 30)
    tier.start()
    assert tier.corrupt == 1 and tier.entries() == {} and not list(d.iterdir())


@pytest.mark.parametrize("swap", ["another snapshot", "another model"])
def test_a_file_replaced_after_start_is_refused_at_load(tmp_path, swap):
    d = tmp_path / "kv"
    d.mkdir()
    _, a, _ = write(d, "resp_a")
    _, b, _ = write(d, "resp_b")
    tier = DiskTier(d, 1 << 30)
    tier.start()
    if swap == "another snapshot":
        b.write_bytes(a.read_bytes())
    else:  # resp_b as the model next door wrote it
        (tmp_path / "other").mkdir()
        write(tmp_path / "other", "resp_b")
        b.write_bytes((tmp_path / "other" / _file_name("resp_b")).read_bytes())
    assert tier.load("resp_b") is None
    assert tier.corrupt == 1 and not b.exists() and not tier.has("resp_b")
    assert tier.load("resp_a").name == "resp_a"
