"""A GGUF file's header, read in one pass: its metadata, and its tensor table with each
tensor's bytes as a numpy view of the mapped file (nothing copied).

The `gguf` package's `GGUFReader` builds a numpy view for every part of every value: a
262,144-entry vocabulary (Gemma 3's) is about 800,000 views and most of a load's time. This
reads the same values with `struct` over the header's bytes; tests/test_gguf.py checks that
its metadata and tensors equal `GGUFReader`'s, on written files and on the real ones.

Layout (GGUF versions 2 and 3, either byte order): magic "GGUF", version u32, tensor count
u64, metadata count u64; each metadata entry a key (string) and a typed value; each tensor
a name, its dimension count u32, dimensions u64 (fastest first), its ggml type u32 and its
offset u64 from the data section, which starts at the next multiple of
`general.alignment` (32 by default). A string is a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from kvjax.io.hf_families import CheckpointError

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# scalar value types: their struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
# the tensor types stored as plain numbers (the rest are quantized blocks, read as bytes)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32,
          27: np.int64, 28: np.float64}


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest dimension first
    data: np.ndarray  # numbers [*reversed(shape)], or quantized bytes [*rows, bytes per row]


class _Cursor:
    """Reads typed values from `buf` (a file's bytes) at a moving offset."""

    def __init__(self, buf: memoryview, order: str):
        self.buf, self.order, self.offset = buf, order, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.offset + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buf[self.offset: self.offset + n], "utf-8")
        self.offset += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"unsupported array item type {item}")
            fmt = self.order + _SCALARS[item]
            items = np.frombuffer(self.buf, np.dtype(fmt), count, self.offset)
            self.offset += items.nbytes
            return items.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unsupported value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: str) -> tuple[dict[str, Any], list[Tensor]]:
    """(metadata {key: value}, tensors in file order) of the GGUF file at `path`: strings,
    numbers and bools as Python values, arrays as lists (as `GGUFReader`'s `contents()`)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        data = np.asarray(np.memmap(path, mode="r"))  # uint8 [file bytes], a plain view
        buf = memoryview(data)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        cur = _Cursor(buf, order)
        cur.offset = 4
        version = cur.scalar("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {VERSIONS})")
        n_tensors, n_meta = cur.scalar("Q"), cur.scalar("Q")
        meta = {}
        for _ in range(n_meta):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment={align!r} is not a power of two")
        start = -(-cur.offset // align) * align
        tensors = [_tensor(data, order, start, info, GGML_QUANT_SIZES, GGMLQuantizationType)
                   for info in infos]
    except (ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
    if len({t.name for t in tensors}) != len(tensors):
        raise CheckpointError(f"{path} names a tensor twice")
    return meta, tensors


def _tensor(data: np.ndarray, order: str, start: int, info, sizes, types) -> Tensor:
    name, dims, kind, offset = info
    ggml_type = types(kind)
    block, nbytes = sizes[ggml_type]
    count = int(np.prod(dims, dtype=np.int64))
    shape = tuple(reversed(dims))
    if kind in _PLAIN:
        dtype = np.dtype(_PLAIN[kind]).newbyteorder(order)
        size = count * dtype.itemsize
    else:  # whole blocks of `nbytes` bytes per `block` numbers along the fastest dimension
        dtype, size = np.dtype(np.uint8), count // block * nbytes
        shape = (*shape[:-1], shape[-1] // block * nbytes)
    begin = start + offset
    if begin + size > data.size:
        raise ValueError(f"tensor {name} runs past the end of the file")
    return Tensor(name, ggml_type, dims, data[begin: begin + size].view(dtype).reshape(shape))
