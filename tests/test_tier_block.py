"""Tier blocks, their files and the host and disk tiers alone (no engine, no device)."""

from __future__ import annotations

import dataclasses
import os
import time

import ml_dtypes
import numpy as np
import pytest

from kvjax import CacheNamespace
from kvjax.cache.node import child_key
from kvjax.cache.tier_block import (
    DamagedBlock,
    ForeignBlock,
    TierBlock,
    checksum,
    file_name,
    read_block,
    write_block,
)
from kvjax.cache.tiers import DiskTier, HostTier, Tiers

ROOT = CacheNamespace(model="m" * 32, adapter="none", position_base=0, attention="causal",
                      kv_dtype="int8")


def block(seed: int, tokens=None, root=ROOT, salts=None, slots: int = 4) -> TierBlock:
    """An int8 page with its scales (2 layers, 2 KV heads, `slots` slots, head dim 8)."""
    rng = np.random.default_rng(seed)
    tokens = tuple(tokens or rng.integers(10, 100, 8).tolist())  # one file size
    salts = tuple(salts or (None,) * (len(tokens) // 4))
    key = b""
    for i, salt in enumerate(salts):
        key = child_key(key, salt, tokens[4 * i:4 * i + 4])
    arrays = {"k": rng.integers(-127, 128, (2, 2, slots, 8), dtype=np.int8),
              "v": rng.integers(-127, 128, (2, 2, slots, 8), dtype=np.int8),
              "k_scale": rng.random((2, 2, slots), dtype=np.float32),
              "v_scale": rng.random((2, 2, slots), dtype=np.float32)}
    return TierBlock(root, key, tokens, salts, arrays, checksum(arrays))


def _same(a: TierBlock, b: TierBlock) -> None:
    assert (a.root, a.key, a.tokens, a.salts, a.digest) == (b.root, b.key, b.tokens, b.salts,
                                                            b.digest)
    assert list(a.arrays) == list(b.arrays)
    for name in a.arrays:
        assert a.arrays[name].dtype == b.arrays[name].dtype
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])


def test_a_block_file_round_trips_bitwise_and_is_the_owners(tmp_path):
    b = block(0, salts=(None, "tenant"))
    path = str(tmp_path / file_name(b.root, b.key))
    size = write_block(path, b)
    assert os.path.getsize(path) == size
    assert os.stat(path).st_mode & 0o777 == 0o600
    _same(read_block(path, b.root, b.key), b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_pages_of_numpy_extension_dtypes_come_back_as_themselves(tmp_path, dtype):
    """bfloat16 and float8 pages (ml_dtypes, which numpy calls '<V2' and '<V1' in
    `dtype.str`) come back with their own dtype and bits, and their checksum names it."""
    kind = np.dtype(getattr(ml_dtypes, dtype))
    b = block(1)
    arrays = {name: (a.astype(np.float32) * 0.37).astype(kind) for name, a in b.arrays.items()
              if name in ("k", "v")}
    b = dataclasses.replace(b, arrays=arrays, digest=checksum(arrays))
    path = str(tmp_path / file_name(b.root, b.key))
    write_block(path, b)
    _same(read_block(path, b.root, b.key), b)
    as_int = {name: a.view(f"<u{kind.itemsize}") for name, a in arrays.items()}
    assert checksum(as_int) != b.digest  # the same bytes read as another type


def _damage(data: bytes, how: str) -> bytes:
    if how == "flipped":
        out = bytearray(data)
        out[-3] ^= 0x10
        return bytes(out)
    return {"truncated": data[:-1], "extended": data + b"\0", "empty": b"",
            "magic": b"X" + data[1:], "header": data[:16] + b"}" + data[17:]}[how]


@pytest.mark.parametrize("how", ["flipped", "truncated", "extended", "empty", "magic",
                                 "header"])
def test_a_damaged_file_is_refused(tmp_path, how):
    b = block(1)
    path = tmp_path / "x.kvpage"
    write_block(str(path), b)
    path.write_bytes(_damage(path.read_bytes(), how))
    with pytest.raises(DamagedBlock):
        read_block(str(path), b.root, b.key)


@pytest.mark.parametrize("field", ["model", "kv_dtype", "key"])
def test_a_file_of_another_block_is_refused(tmp_path, field):
    b = block(2)
    path = str(tmp_path / "x.kvpage")
    write_block(path, b)
    root = CacheNamespace(**{**ROOT.__dict__, field: "other"}) if field != "key" else ROOT
    key = b.key if field != "key" else bytes(16)
    with pytest.raises(ForeignBlock):
        read_block(path, root, key)


def test_the_host_tier_evicts_least_recently_used_first():
    blocks = [block(i) for i in range(4)]
    host = HostTier(3 * blocks[0].nbytes)
    for b in blocks[:3]:
        assert host.put(b) == []
    assert host.get((ROOT, blocks[0].key)) is blocks[0]  # 0 used: 1 is now the oldest
    assert host.put(blocks[3]) == [blocks[1]]
    assert host.bytes == 3 * blocks[0].nbytes
    big = block(9, slots=64)  # 16 pages' bytes: larger than the whole tier
    assert big.nbytes > host.capacity
    assert host.put(big) == [big]  # handed straight back, nothing evicted for it
    assert host.bytes == 3 * blocks[0].nbytes
    assert list(host.blocks) == [(ROOT, b.key) for b in (blocks[2], blocks[0], blocks[3])]


def test_the_disk_tier_is_rebuilt_from_its_folder_and_keeps_its_bound(tmp_path):
    blocks = [block(i) for i in range(5)]
    one = write_block(str(tmp_path / "probe"), blocks[0])
    os.remove(tmp_path / "probe")
    disk = DiskTier(str(tmp_path), 3 * one)
    for b in blocks[:3]:
        disk.put(b)
        time.sleep(0.01)  # distinct file times: the order a new index reads
    disk.get((ROOT, blocks[0].key))  # used again: 1 is the oldest now
    again = DiskTier(str(tmp_path), 3 * one)  # a new process's index
    assert len(again) == 3 and again.bytes == 3 * one
    again.put(blocks[3])
    names = {p.name for p in tmp_path.glob("*.kvpage")}
    assert file_name(ROOT, blocks[1].key) not in names
    assert file_name(ROOT, blocks[0].key) in names
    _same(again.get((ROOT, blocks[0].key)), blocks[0])
    smaller = DiskTier(str(tmp_path), 2 * one)  # a smaller bound trims at start
    assert smaller.bytes <= 2 * one and len(list(tmp_path.glob("*.kvpage"))) == 2


def test_the_disk_tier_skips_counts_and_deletes_a_damaged_file(tmp_path):
    b = block(3)
    disk = DiskTier(str(tmp_path), 1 << 20)
    disk.put(b)
    path = tmp_path / file_name(ROOT, b.key)
    path.write_bytes(_damage(path.read_bytes(), "flipped"))
    with pytest.warns(UserWarning, match="damaged"):
        assert disk.get((ROOT, b.key)) is None
    assert disk.stats["skipped_damaged"] == 1 and not path.exists() and disk.bytes == 0


def test_tiers_cascade_and_never_return_another_history(tmp_path):
    """Host (2 blocks) over disk: a third block pushes the oldest to disk; finding it there
    brings it back to host memory. A block filed under a key but holding another history
    (what a key collision would look like) or another salt is skipped, never returned."""
    blocks = [block(i) for i in range(3)]
    tiers = Tiers(2 * blocks[0].nbytes, str(tmp_path), 1 << 20)
    tiers.spill(blocks)
    host, disk = tiers.levels
    assert len(host) == 2 and len(disk) == 1
    found, tier = tiers.find((ROOT, blocks[0].key), blocks[0].tokens, blocks[0].salts)
    assert tier == "disk"
    _same(found, blocks[0])
    assert host.has((ROOT, blocks[0].key))
    liar = block(4)
    liar.key = blocks[2].key  # filed under block 2's key, another history
    host.discard((ROOT, blocks[2].key))
    host.put(liar)
    with pytest.warns(UserWarning, match="foreign"):
        assert tiers.find((ROOT, liar.key), blocks[2].tokens, blocks[2].salts) is None
    b0 = blocks[0]
    with pytest.warns(UserWarning, match="foreign"):
        assert tiers.find((ROOT, b0.key), b0.tokens, ("tenant",) * len(b0.salts)) is None
    assert host.stats["skipped_foreign"] == 2 and len(host) == 0


def test_a_host_block_that_fails_its_checksum_is_skipped():
    """Memory that changed under a kept block (a bit flipped in place) is never restored."""
    b = block(5)
    tiers = Tiers(1 << 20)
    tiers.spill([b])
    b.arrays["k"][0, 0, 0, 0] ^= 1
    with pytest.warns(UserWarning, match="damaged"):
        assert tiers.find((ROOT, b.key), b.tokens, b.salts) is None
    host = tiers.levels[0]
    assert host.stats["skipped_damaged"] == 1 and len(host) == 0 and host.bytes == 0
