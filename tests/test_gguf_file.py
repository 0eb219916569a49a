"""`kvjax.io.gguf_file.read_gguf` against the `gguf` package's `GGUFReader` on the same
files: every metadata value (each GGUF value type, arrays of each) and every tensor's type,
dimensions and bytes, in both byte orders, with several alignments, and on the real model
files; damaged files are refused with the path named."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvjax import models
from kvjax.io.gguf_file import read_gguf
from kvjax.io.hf import CheckpointError

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

VALUES = {  # key: (value, GGUF type); one of every scalar type, arrays of each item type
    "t.u8": (200, gguf.GGUFValueType.UINT8), "t.i8": (-100, gguf.GGUFValueType.INT8),
    "t.u16": (60000, gguf.GGUFValueType.UINT16), "t.i16": (-30000, gguf.GGUFValueType.INT16),
    "t.u32": (4_000_000_000, gguf.GGUFValueType.UINT32),
    "t.i32": (-2_000_000_000, gguf.GGUFValueType.INT32),
    "t.f32": (0.1, gguf.GGUFValueType.FLOAT32), "t.bool": (True, gguf.GGUFValueType.BOOL),
    "t.str": ("Café 🙂", gguf.GGUFValueType.STRING),
    "t.u64": (2**63 + 5, gguf.GGUFValueType.UINT64), "t.i64": (-(2**62), gguf.GGUFValueType.INT64),
    "t.f64": (0.1, gguf.GGUFValueType.FLOAT64),
}


def _write(path, endian, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, kind) in VALUES.items():
        w.add_key_value(key, value, kind)
    w.add_array("a.ints", [3, -1, 7])
    w.add_array("a.floats", [0.5, -2.25, 1e-3])
    w.add_array("a.bools", [True, False])
    w.add_array("a.strings", ["", "a", "日本", "x" * 300])
    w.add_array("a.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in (T.Q8_0, T.Q4_1, T.BF16):  # quantized rows: bytes, as GGUFReader gives them
        x = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(kind.name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_as_gguf_reads(path) -> tuple[dict, list]:
    meta, tensors = read_gguf(str(path))
    ref = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(want)
    for key, value in want.items():
        assert meta[key] == value, key
        assert type(meta[key]) is type(value), key
        if isinstance(value, list):  # and the elements' types
            assert [type(v) for v in meta[key][:3]] == [type(v) for v in value[:3]], key
    assert [t.name for t in tensors] == [t.name for t in ref.tensors]
    for got, t in zip(tensors, ref.tensors, strict=True):
        assert (got.tensor_type, got.shape) == (t.tensor_type, tuple(t.shape.tolist())), t.name
        assert (got.data.dtype, got.data.shape) == (t.data.dtype, t.data.shape), t.name
        np.testing.assert_array_equal(got.data, t.data)
    return meta, tensors


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG],
                         ids=["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_every_value_type_and_tensor_reads_as_gguf_reads_it(tmp_path, endian, alignment):
    meta, tensors = _assert_as_gguf_reads(_write(tmp_path / "all.gguf", endian, alignment))
    assert meta["t.str"] == "Café 🙂" and meta["t.u64"] == 2**63 + 5
    assert meta["a.strings"][3] == "x" * 300 and meta["a.bools"] == [True, False]
    f32 = next(t for t in tensors if t.name == "f32")
    assert f32.shape == (5, 3) and f32.data.shape == (3, 5)  # GGUF dims fastest first
    q8 = next(t for t in tensors if t.name == "Q8_0")
    assert q8.data.shape == (4, 64 // 32 * 34)  # 2 blocks of fp16 scale + 32 int8 per row
    np.testing.assert_array_equal(gguf.quants.dequantize(q8.data, q8.tensor_type).shape, (4, 64))


def test_the_real_file_reads_as_gguf_reads_it():
    """The default model's file (F32, Q8_0, Q4_1; a 49,152-token vocabulary). (Gemma 3's,
    with K-quants and 262,144 tokens, 15 s here: its load is checked end to end against
    transformers' in tests/test_gemma3.py.)"""
    try:
        path = models.path("smollm2-135m-instruct")
    except models.ModelNotInstalledError as e:
        if os.environ.get("KVJAX_NO_MODELS"):
            pytest.skip(f"KVJAX_NO_MODELS is set: {e}")
        pytest.fail(f"{e} (scripts/test installs it)")
    meta, tensors = _assert_as_gguf_reads(path)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type for t in tensors} == {T.F32, T.Q8_0, T.Q4_1}


@pytest.mark.parametrize(("damage", "match"), [
    (lambda b: b"GGML" + b[4:], "no GGUF magic"),
    (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "GGUF version 9"),
    (lambda b: b[:200], "past the end|unpack_from requires"),
    (lambda b: b[:-100], "tensor BF16 runs past the end of the file"),
    (lambda b: b[:24] + (2**40).to_bytes(8, "little") + b[32:],
     "a string of 1099511627776 bytes runs past the end"),
], ids=["magic", "version", "cut-in-the-header", "cut-in-the-data", "string-length"])
def test_a_damaged_file_is_refused_with_its_path(tmp_path, damage, match):
    good = _write(tmp_path / "good.gguf", gguf.GGUFEndian.LITTLE).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good))
    with pytest.raises(CheckpointError, match=rf"bad\.gguf is not a readable GGUF file: "
                                              rf"(.*)({match})"):
        read_gguf(str(bad))
