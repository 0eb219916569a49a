"""One evicted page as the host and disk tiers keep it, and its file format. Host code: numpy.

A `TierBlock` is a full page's stored K/V (bit for bit what the device held: int8 pages
with their scales) with everything that decides whether a request may reuse it: the root
namespace (model, adapter, position base, attention, format), the whole token history from
the root to the end of the page, the salt of every page of that history, and a checksum of
the arrays. A tier finds a block by its path key (`kvjax.cache.node.child_key`), but a
block is reused only when all of those compare equal to the request's and the checksum
still holds: never by a key alone.

File (one per block): MAGIC, the header's length (uint64 little endian), the header (JSON:
namespace, key, tokens, salts, each array's name, dtype and shape, the checksum), then the
arrays' bytes in the header's order. `read_block` refuses a truncated, corrupted or foreign
file with `DamagedBlock` or `ForeignBlock`, never returning its contents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct

import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 names with numpy)
import numpy as np

from kvjax.cache.identity import CacheNamespace

MAGIC = b"KVJAXPG1"
_LEN = struct.Struct("<Q")


class DamagedBlock(ValueError):
    """A block file that is truncated, corrupted or not a block file."""


class ForeignBlock(ValueError):
    """A block file that is intact but holds another block (another namespace or key)."""


def _dtype_tag(dtype: np.dtype) -> str:
    """How a block names an array's dtype: numpy's type string ('<f4'), or the name for an
    ml_dtypes type (bfloat16, float8_e4m3fn), whose type string ('<V2', '<V1') would read
    back as raw bytes. `np.dtype(tag)` is the dtype again."""
    return dtype.name if dtype.kind == "V" else dtype.str


def _bytes(a: np.ndarray) -> memoryview:
    """The array's bytes in C order (ml_dtypes arrays do not export a buffer themselves)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every array's name, dtype, shape and bytes (in `arrays`' order)."""
    h = hashlib.sha256()
    for name, a in arrays.items():
        h.update(f"{name}:{_dtype_tag(a.dtype)}:{a.shape}".encode())
        h.update(_bytes(a))
    return h.hexdigest()


@dataclasses.dataclass
class TierBlock:
    """A page kept below the device (module docstring)."""

    root: CacheNamespace  # the namespace without salt
    key: bytes  # path key of the page in the trie
    tokens: tuple[int, ...]  # the history from the root through this page
    salts: tuple[str | None, ...]  # one per page of the history
    arrays: dict[str, np.ndarray]  # k, v [layers, kv_heads, page_size, head_dim] (+ scales)
    digest: str  # checksum(arrays) when the page left the device

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) of each array (`kvjax.cache.paged.page_layout`'s form)."""
        return {name: (str(a.dtype), tuple(a.shape)) for name, a in self.arrays.items()}

    def intact(self) -> bool:
        return checksum(self.arrays) == self.digest

    def same_history(self, root: CacheNamespace, tokens, salts) -> bool:
        """Whether this block is exactly the page of `tokens` (the history through it) and
        `salts` (its pages') under `root`."""
        return self.root == root and self.tokens == tuple(tokens) and \
            self.salts == tuple(salts)


def file_name(root: CacheNamespace, key: bytes) -> str:
    """The block's file name: a digest of the root namespace, then the path key."""
    ns = hashlib.sha256(json.dumps(dataclasses.asdict(root), sort_keys=True).encode())
    return f"{ns.hexdigest()[:24]}-{key.hex()}.kvpage"


def write_block(path: str, block: TierBlock) -> int:
    """Writes `block` to `path` (atomically: a temporary file renamed; readable by the owner
    only); returns the file's bytes."""
    header = json.dumps({
        "namespace": dataclasses.asdict(block.root), "key": block.key.hex(),
        "tokens": list(block.tokens), "salts": list(block.salts), "checksum": block.digest,
        "arrays": [[name, _dtype_tag(a.dtype), list(a.shape)] for name, a in block.arrays.items()],
    }).encode()
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(MAGIC + _LEN.pack(len(header)) + header)
        for a in block.arrays.values():
            f.write(_bytes(a))
    os.replace(tmp, path)
    return len(MAGIC) + _LEN.size + len(header) + block.nbytes


def read_block(path: str, root: CacheNamespace | None = None,
               key: bytes | None = None) -> TierBlock:
    """The block in `path`, checked: raises `DamagedBlock` (truncated, corrupted, not a
    block file) or `ForeignBlock` (another namespace or key than `root`, `key`; without
    them, whatever intact block the file holds, for inspection)."""
    with open(path, "rb") as f:
        data = f.read()
    start = len(MAGIC) + _LEN.size
    if len(data) < start or data[:len(MAGIC)] != MAGIC:
        raise DamagedBlock(f"{path}: not a kvjax page file")
    (size,) = _LEN.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start:start + size])
        namespace = CacheNamespace(**header["namespace"])
        specs = [(name, np.dtype(dt), tuple(shape)) for name, dt, shape in header["arrays"]]
    except (ValueError, TypeError, KeyError) as e:
        raise DamagedBlock(f"{path}: unreadable header ({e})") from e
    offset = start + size
    arrays = {}
    for name, dtype, shape in specs:
        n = int(np.prod(shape)) * dtype.itemsize
        if offset + n > len(data):
            raise DamagedBlock(f"{path}: truncated")
        arrays[name] = np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape)
        offset += n
    if offset != len(data):
        raise DamagedBlock(f"{path}: {len(data) - offset} bytes past its arrays")
    block = TierBlock(namespace, bytes.fromhex(header["key"]), tuple(header["tokens"]),
                      tuple(header["salts"]), arrays, header["checksum"])
    if not block.intact():
        raise DamagedBlock(f"{path}: checksum mismatch")
    if root is not None and (block.root != root or block.key != key):
        raise ForeignBlock(f"{path}: holds another block (namespace fields "
                           f"{root.differing_fields(block.root) or 'equal'})")
    return block
