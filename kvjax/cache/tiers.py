"""The tiers below the device pool: host memory, then a folder on disk. Host code: numpy.

A full page the device pool evicts leaves as a `TierBlock` (`kvjax.cache.tier_block`) into
the host tier; a block the host tier evicts (least recently used first) goes to the disk
tier, which evicts the least recently used files past its bound. Each tier holds at most
its bytes. A block found for a request (by its path key, then checked: checksum, root
namespace, the whole token history and every page's salt) is restored into a fresh device
page by the pool (`PagePool.restore`); a block restored from disk is kept in host memory
too. Nothing a tier holds is reused on a key alone: a block that fails a check is skipped,
counted (`skipped`) and dropped, with a warning.

The disk tier outlives the process: its index is the folder (file names carry the root
namespace's digest and the path key; the least recently used order is the files' times),
read again when a pool starts. Files are written atomically and readable by the owner only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
import warnings
from collections.abc import Sequence

from kvjax.cache.identity import CacheNamespace
from kvjax.cache.tier_block import (
    DamagedBlock,
    ForeignBlock,
    TierBlock,
    file_name,
    read_block,
    write_block,
)

Key = tuple[CacheNamespace, bytes]  # (root namespace, path key)


class TierStats(collections.Counter):
    """Per tier: blocks stored and restored, their bytes, evictions, skipped blocks."""


class HostTier:
    """Blocks in host memory, at most `capacity` bytes, least recently used out first."""

    name = "host"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: collections.OrderedDict[Key, TierBlock] = collections.OrderedDict()
        self.bytes = 0
        self.stats = TierStats()

    def has(self, key: Key) -> bool:
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return True
        return False

    def get(self, key: Key) -> TierBlock | None:
        """The block kept under `key` if its checksum still holds; a block that fails it is
        skipped with a warning, counted and dropped."""
        block = self.blocks.get(key)
        if block is None:
            return None
        if not block.intact():
            self.stats["skipped_damaged"] += 1
            warnings.warn("kvjax host tier: skipped a damaged page (recomputed instead)",
                          stacklevel=3)
            self.discard(key)
            return None
        self.blocks.move_to_end(key)
        return block

    def discard(self, key: Key) -> None:
        self.bytes -= self.blocks.pop(key).nbytes

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Keeps `block`; returns the blocks evicted to make room (oldest first), `block`
        itself when it is larger than the tier."""
        key = (block.root, block.key)
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return []
        if block.nbytes > self.capacity:
            return [block]
        self.blocks[key] = block
        self.bytes += block.nbytes
        self.stats["stored_pages"] += 1
        self.stats["stored_bytes"] += block.nbytes
        out = []
        while self.bytes > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes
            self.stats["evictions"] += 1
            out.append(old)
        return out

    def __len__(self) -> int:
        return len(self.blocks)


class DiskTier:
    """Block files in `folder`, at most `capacity` bytes (module docstring)."""

    name = "disk"

    def __init__(self, folder: str, capacity: int):
        self.folder = folder
        self.capacity = capacity
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.stats = TierStats()
        # file name -> bytes, least recently used first (a restart reads the files' times)
        self.files: collections.OrderedDict[str, int] = collections.OrderedDict()
        found = []
        for entry in os.scandir(folder):
            if entry.name.endswith(".kvpage") and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self.files[name] = size
        self.bytes = sum(self.files.values())
        # each write or use stamps its file a nanosecond past the last stamp at least, so
        # the order a restart reads back is the order of use, even within a clock tick
        self._stamp = max((t for t, _, _ in found), default=0)
        self._trim()

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _touch(self, name: str) -> None:
        self.files.move_to_end(name)
        self._stamp = max(time.time_ns(), self._stamp + 1)
        try:
            os.utime(self._path(name), ns=(self._stamp, self._stamp))
        except FileNotFoundError:
            self._forget(name)

    def _forget(self, name: str, delete: bool = False) -> None:
        self.bytes -= self.files.pop(name, 0)
        if delete:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(name))

    def _trim(self) -> None:
        while self.bytes > self.capacity and self.files:
            self._forget(next(iter(self.files)), delete=True)
            self.stats["evictions"] += 1

    def holds(self, key: Key) -> bool:
        """Whether `key` is filed (nothing marked used)."""
        return file_name(*key) in self.files

    def has(self, key: Key) -> bool:
        name = file_name(*key)
        if name in self.files:
            self._touch(name)
        return name in self.files

    def get(self, key: Key) -> TierBlock | None:
        """The block filed under `key`, checked (`read_block`); a damaged or foreign file is
        skipped with a warning, counted and deleted."""
        name = file_name(*key)
        if name not in self.files:
            return None
        try:
            block = read_block(self._path(name), *key)
        except FileNotFoundError:
            self._forget(name)
            return None
        except (DamagedBlock, ForeignBlock) as e:
            kind = "damaged" if isinstance(e, DamagedBlock) else "foreign"
            self.stats[f"skipped_{kind}"] += 1
            warnings.warn(f"kvjax disk tier: skipped a {kind} page file: {e}", stacklevel=2)
            self._forget(name, delete=True)
            return None
        self._touch(name)
        return block

    def discard(self, key: Key) -> None:
        self._forget(file_name(*key), delete=True)

    def put(self, block: TierBlock) -> list[TierBlock]:
        """Writes `block` unless it is filed already, then deletes the least recently used
        files past the bound. Returns [] (nothing goes further down)."""
        name = file_name(block.root, block.key)
        if name in self.files:
            self._touch(name)
            return []
        size = write_block(self._path(name), block)
        self.files[name] = size
        self._touch(name)
        self.bytes += size
        self.stats["stored_pages"] += 1
        self.stats["stored_bytes"] += size
        self._trim()
        return []

    def __len__(self) -> int:
        return len(self.files)


class Tiers:
    """The host tier and the disk tier (either may be absent), as one store."""

    def __init__(self, host_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0,
                 layout: dict | None = None):
        self.layout = layout  # the pool's page layout (`paged.page_layout`); None: unchecked
        self.levels: list[HostTier | DiskTier] = []
        if host_bytes:
            self.levels.append(HostTier(host_bytes))
        if disk_dir is not None:
            self.levels.append(DiskTier(disk_dir, disk_bytes))
        self.restore_s = 0.0

    @classmethod
    def for_cache(cls, cache, layout: dict) -> Tiers | None:
        """The tiers a `CacheConfig` asks for (pages of `layout`), or None when it asks for
        none."""
        if not cache.host_bytes and cache.disk_dir is None:
            return None
        return cls(cache.host_bytes, cache.disk_dir, cache.disk_bytes, layout)

    @property
    def disk(self) -> DiskTier | None:
        return next((level for level in self.levels if isinstance(level, DiskTier)), None)

    def persist_host(self) -> None:
        """Writes the blocks host memory holds (least recently used first) to the disk
        tier, which keeps them past the process (`PagePool.persist`)."""
        if self.disk is not None and self.levels[0] is not self.disk:
            for block in list(self.levels[0].blocks.values()):
                self.disk.put(block)

    def has(self, key: Key) -> bool:
        """Whether a tier holds `key` (marking it used): an evicted page need not be read."""
        return any(level.has(key) for level in self.levels)

    def spill(self, blocks: Sequence[TierBlock]) -> None:
        """Blocks the device evicted enter the first tier; what each tier evicts enters the
        next one; what the last one evicts is gone."""
        for level in self.levels:
            out: list[TierBlock] = []
            for block in blocks:
                out += level.put(block)
            blocks = out

    def find(self, key: Key, tokens, salts) -> tuple[TierBlock, str] | None:
        """(block, tier name) of the first tier holding exactly the page `key` names for the
        history `tokens` with page salts `salts`, its checksum checked (by the tier), or
        None. A block found on disk is kept in
        host memory too (what that evicts goes to disk as usual)."""
        for i, level in enumerate(self.levels):
            block = level.get(key)
            if block is None:
                continue
            # never on a key alone; and a file another kvjax wrote for another layout of the
            # same format (its namespace names the format, not its arrays) is foreign too
            other = None
            if not block.same_history(key[0], tokens, salts):
                other = "history"
            elif self.layout is not None and block.layout != self.layout:
                other = "page layout"
            if other is not None:
                level.stats["skipped_foreign"] += 1
                warnings.warn(f"kvjax {level.name} tier: skipped a foreign page (another "
                              f"{other} under its key; recomputed instead)", stacklevel=2)
                level.discard(key)
                return None
            level.stats["restored_pages"] += 1
            level.stats["restored_bytes"] += block.nbytes
            if i > 0:
                self.spill([block])
            return block, level.name
        return None

    def stats(self) -> dict:
        """Per tier: pages and bytes held now, and the counters; restore seconds."""
        out = {level.name: {"pages": len(level), "bytes": level.bytes,
                            "capacity_bytes": level.capacity, **level.stats}
               for level in self.levels}
        out["restore_s"] = self.restore_s
        return out
