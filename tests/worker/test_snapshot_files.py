"""KV snapshot files and the disk tier (worker/snapshots/files.py, disk.py): every cache
kind round-trips (bf16, recurrent, quantized), mlx-lm reads the files, a damaged file is
deleted and counted and never loaded, the byte budget drops the least recently used."""

from __future__ import annotations

import os
import stat

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, load_prompt_cache

from worker.snapshots import files
from worker.snapshots.disk import DiskTier, _file_name
from worker.snapshots.identity import model_identity


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


def write(tmp_path, name="resp_1", tokens=7, **kw):
    cache = a_cache(tokens, **kw)
    path = tmp_path / _file_name(name)
    size = files.write(files.encode(name, list(range(100, 100 + tokens)), cache), path)
    return cache, path, size


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
    assert files.read_info(path) == files.Info("resp_1", 7, size)


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
    (model / "model.safetensors").write_bytes(b"12345")
    assert model_identity(model) != first
