"""The row-count-invariant CPU product (kvjax/cpu): a row's bits across row counts and
neighbours, its values against a float64 product, the library cache, and the fallback when
no library can be built."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cpu import build
from kvjax.cpu.product import kernel, pack, product, unpack

needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())
# (I, O, w stored [O, I]): SmolLM2's q/o, k/v, MLP up and down, a head's shape, and odd
# sizes for the input chunk, the output panel, the lane and the row tails
SHAPES = [(576, 576, False), (576, 192, False), (576, 1536, False), (1536, 576, False),
          (100, 130, False), (37, 7, False), (576, 1000, True), (37, 10, True)]
ROW_COUNTS = [*range(1, 14), 31, 64, 100, 255, 256, 512]


def _weights(i: int, o: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((i, o)) / np.sqrt(i)).astype(np.float32)


_product = jax.jit(product, static_argnums=2)


def _stored(w: np.ndarray, transposed: bool) -> jax.Array:
    """w [I, O] as `product` takes it: [O, I] transposed, else packed."""
    return jnp.asarray(w.T) if transposed else pack(jnp.asarray(w))


@needs_kernel
@pytest.mark.parametrize(("i", "o", "transposed"), SHAPES)
def test_a_rows_bits_are_the_same_for_every_row_count_and_neighbour(i, o, transposed):
    w = _weights(i, o)
    stored = _stored(w, transposed)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, i)).astype(np.float32)
    alone = np.concatenate([np.asarray(_product(jnp.asarray(x[r:r + 1]), stored, transposed))
                            for r in range(16)])
    full = np.asarray(_product(jnp.asarray(x), stored, transposed))
    np.testing.assert_array_equal(full[:16], alone)
    for count in ROW_COUNTS:
        got = np.asarray(_product(jnp.asarray(x[:count]), stored, transposed))
        np.testing.assert_array_equal(got, full[:count], err_msg=f"{count} rows")
    # the same rows beside other neighbours, at other places in the block of rows
    other = rng.standard_normal((512, i)).astype(np.float32)
    for count, at in ((2, 1), (7, 3), (6, 5), (40, 17), (300, 299)):
        mixed = other[:count].copy()
        mixed[at] = x[0]
        got = np.asarray(_product(jnp.asarray(mixed), stored, transposed))
        np.testing.assert_array_equal(got[at], full[0], err_msg=f"row {at} of {count}")


@needs_kernel
@pytest.mark.parametrize(("i", "o", "transposed"), SHAPES)
def test_values_within_ten_times_the_measured_error_of_a_float64_product(i, o, transposed):
    w = _weights(i, o, seed=2)
    x = np.random.default_rng(3).standard_normal((64, i)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(_product(jnp.asarray(x), _stored(w, transposed), transposed), np.float64)
    # measured: one chain over I (w [I, O]) 3.5e-6 at I = 576, 7.7e-6 at I = 1536 (XLA's
    # own product 3.1e-6, 2.7e-6); 16 lanes (w [O, I]) 6.3e-7 at 576
    assert np.abs(got - want).max() < 8e-5
    # the leading dimensions of x are kept
    y = product(jnp.asarray(x.reshape(4, 16, i)), _stored(w, transposed), transposed)
    assert y.shape == (4, 16, o)
    np.testing.assert_array_equal(np.asarray(y).reshape(64, o), got.astype(np.float32))


@pytest.mark.parametrize("shape", [(5, 100), (5, 64), (3, 7), (4, 3, 128), (2, 3, 5)])
def test_pack_streams_panels_of_64_outputs_then_the_rest_and_unpacks(shape):
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    inputs = 2 if len(shape) == 3 and shape[-1] == 5 else 1  # an o kernel [N, H, D]
    packed = np.asarray(pack(jnp.asarray(w), inputs))
    assert packed.shape == w.shape
    flat, out = w.reshape(-1, w.size // np.prod(shape[:inputs])), w.size // np.prod(
        shape[:inputs])
    full = out // 64 * 64
    want = np.concatenate([flat[:, :full].reshape(len(flat), -1, 64).transpose(1, 0, 2)
                           .reshape(-1), flat[:, full:].reshape(-1)])
    np.testing.assert_array_equal(packed.reshape(-1), want)
    if full:  # panel 0 holds outputs 0..63 of every input, input by input
        np.testing.assert_array_equal(packed.reshape(-1)[:64 * len(flat)],
                                      flat[:, :64].reshape(-1))
    np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(packed), inputs)), w)


@needs_kernel
def test_the_library_is_cached_by_source_compiler_cpu_and_jaxlib(tmp_path, monkeypatch):
    env = {"KVJAX_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = build.build(jax.ffi.include_dir(), "jaxlib-x", env)
    assert first.reason == "built" and first.path.exists()
    again = build.build(jax.ffi.include_dir(), "jaxlib-x", env)
    assert again == build.Build(first.path, "cached")
    other = build.build(jax.ffi.include_dir(), "jaxlib-y", env)  # another jaxlib: rebuilt
    assert other.reason == "built" and other.path != first.path
    monkeypatch.setattr(build, "cpu_features", lambda: "another cpu")
    assert build.build(jax.ffi.include_dir(), "jaxlib-x", env).path not in (first.path,
                                                                           other.path)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".so"] * 3  # no temporaries


def _raw_attention(lib, case) -> np.ndarray:
    """kvjax_attention_raw on `case` (the arrays and dims of `_attention_case`)."""
    q, k, v, table, lengths, num_new, dims = case
    out = np.zeros_like(q)
    f, i32 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32)
    lib.kvjax_attention_raw(q.ctypes.data_as(f), k.ctypes.data_as(f), v.ctypes.data_as(f),
                            table.ctypes.data_as(i32), lengths.ctypes.data_as(i32),
                            num_new.ctypes.data_as(i32), out.ctypes.data_as(f),
                            dims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
    return out


def _attention_case(h: int):
    """Two sequences (21 cached + 4 new, 37 + 2) over float32 pages of 4, 6 query heads
    over 2 KV heads of `h`, window 9, layer 1 of 2."""
    rng = np.random.default_rng(h)
    k, v = (np.ascontiguousarray(rng.standard_normal((2, 2, 24, 4, h)), np.float32)
            for _ in range(2))
    q = np.ascontiguousarray(rng.standard_normal((2, 4, 6, h)) / 2, np.float32)
    table = np.arange(24, dtype=np.int32).reshape(2, 12)
    lengths, num_new = np.array([21, 37], np.int32), np.array([4, 2], np.int32)
    dims = np.array([1, 2, 4, 6, 2, h, 24, 4, 12, 9], np.int64)
    return q, k, v, table, lengths, num_new, dims


@needs_kernel
def test_avx512_avx2_and_scalar_builds_give_the_same_bits(tmp_path):
    """The order of each sum is fixed by I alone, not by the vector width: the library built
    for 16-float, 8-float and no vectors (software fma) gives the same bits; its attention
    too (the numpy reference's bits, kvjax.cpu.attention), whose 16-lane tree takes vector
    instructions where there are some."""
    from kvjax.cpu.attention import reference

    env = {"KVJAX_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    widths = {"native": (), "avx2": ("-mno-avx512f",),
              "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
    rng = np.random.default_rng(4)
    outs, isas = {}, {}
    for name, flags in widths.items():
        made = build.build(jax.ffi.include_dir(), "jaxlib-x", env, flags)
        assert made.path is not None, made.reason
        lib = ctypes.CDLL(str(made.path))
        lib.kvjax_product_isa.restype = ctypes.c_char_p
        isas[name] = lib.kvjax_product_isa().decode()
        for i, o, transposed in [(100, 130, False), (37, 10, True), (576, 64, True)]:
            w = _weights(i, o, seed=5)
            stored = np.ascontiguousarray(np.asarray(_stored(w, transposed)), np.float32)
            x = np.ascontiguousarray(rng.standard_normal((7, i)), np.float32) if name == \
                "native" else outs[("x", i, o)]
            y = np.zeros((7, o), np.float32)
            ptr = ctypes.POINTER(ctypes.c_float)
            lib.kvjax_product_raw(x.ctypes.data_as(ptr), stored.ctypes.data_as(ptr),
                                  y.ctypes.data_as(ptr), ctypes.c_int64(7), ctypes.c_int64(i),
                                  ctypes.c_int64(o), ctypes.c_int(transposed))
            outs[("x", i, o)] = x
            outs[(name, i, o)] = y
            if name == "native":  # the raw entry is the FFI product's arithmetic
                np.testing.assert_array_equal(
                    y, np.asarray(_product(jnp.asarray(x), jnp.asarray(stored), transposed)))
            else:
                np.testing.assert_array_equal(y, outs[("native", i, o)], err_msg=name)
        for h in (64, 20):
            case = _attention_case(h)
            q, k, v, table, lengths, num_new, _ = case
            want = reference(q, k, v, 1, table, lengths, num_new, 9, 1.0)
            # the raw entry takes queries already scaled (scale 1.0 in the reference)
            np.testing.assert_array_equal(_raw_attention(lib, case), want, err_msg=name)
    assert isas["avx2"] in ("avx2", "scalar") and isas["scalar"] == "scalar"
    assert isas["native"] == kernel().isa


def test_no_compiler_or_a_failed_build_says_why_and_builds_nothing(tmp_path):
    env = {"KVJAX_KERNEL_CACHE": str(tmp_path), "PATH": str(tmp_path)}
    made = build.build(jax.ffi.include_dir(), "jaxlib-x", env)
    assert made == build.Build(None, "no C++ compiler found ($CXX, c++, g++)")
    (tmp_path / "c++").write_text("#!/bin/sh\necho 'no such header' >&2\nexit 1\n")
    (tmp_path / "c++").chmod(0o755)
    made = build.build(jax.ffi.include_dir(), "jaxlib-x", env)
    assert made.path is None and "no such header" in made.reason
    assert list(tmp_path.glob("*.so")) == []
    (tmp_path / "file").write_text("")  # a cache folder that cannot be made
    made = build.build(jax.ffi.include_dir(), "jaxlib-x",
                       {**env, "KVJAX_KERNEL_CACHE": str(tmp_path / "file" / "cache")})
    assert made.path is None and made.reason.startswith("cannot write the kernel cache")


@pytest.mark.parametrize(("env", "why"), [
    ({"PATH": "/nonexistent"}, "no C++ compiler found"),
    ({"KVJAX_CPU_KERNEL": "0"}, "KVJAX_CPU_KERNEL=0"),
])
def test_a_process_without_the_kernel_says_so(tmp_path, env, why):
    code = ("from kvjax.cpu.product import kernel; k = kernel(); "
            "print(k.available); print(k.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"KVJAX_KERNEL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin",
                              "JAX_PLATFORMS": "cpu", **env}, check=True).stdout.split("\n")
    assert out[0] == "False" and out[1].startswith("pure-JAX products") and why in out[1]


def test_ci_stops_where_the_kernel_is_missing():
    """`.ci/run` sets KVJAX_REQUIRE_KERNEL=1: a run without the kernel then stops before any
    test (the kernel tests would skip, hiding a broken build); without the variable the
    same run passes (users keep the pure-JAX fallback)."""
    from pathlib import Path

    def run(require: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
             "no:randomly", "tests/test_gemma3.py::test_a_missing_model_fails_where_it_was_"
             "asked_for"], capture_output=True, text=True, check=False,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "KVJAX_CPU_KERNEL": "0", "KVJAX_REQUIRE_KERNEL": require})

    stopped, passed = run("1"), run("0")
    assert stopped.returncode == 1, stopped.stdout[-2000:]
    assert "KVJAX_REQUIRE_KERNEL=1 and kvjax's CPU kernel is not in use" in stopped.stdout
    assert passed.returncode == 0, passed.stdout[-2000:]


# Eight attention calls and an XLA dot with no data between them: XLA runs such ops on its
# pool's threads at once, and the dot's own pool tasks wait behind them.
_CONCURRENT_CALLS = """
import jax, jax.numpy as jnp, numpy as np
B, N, H, K, P, S = 4, 9, 64, 3, 64, 16
rng = np.random.default_rng(0)
k, v = (jnp.asarray(rng.standard_normal((2, K, P, S, H)), jnp.float32) for _ in range(2))
table = jnp.asarray(np.arange(B * 16).reshape(B, 16) % P, jnp.int32)
lengths, one = jnp.full((B,), 200, jnp.int32), jnp.ones((B,), jnp.int32)
q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
big = jnp.asarray(rng.standard_normal((512, 512)), jnp.float32)
from kvjax.cpu.attention import TARGET
from kvjax.cpu.product import kernel
assert kernel().available, kernel().describe()
call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))

def body(j, q):
    outs = [call(q + i, k, v, jnp.array([i % 2], jnp.int32), table, lengths, one,
                 jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 1, 1), jnp.int32),
                 window=np.int64(0), tree=False) for i in range(8)]
    return sum(outs) * 1e-3 + jnp.dot(big + j, big)[0, 0]

f = jax.jit(lambda q: jax.lax.fori_loop(0, 4, body, q))
for _ in range(40):
    jax.block_until_ready(f(q))
print("finished")
"""


@needs_kernel
def test_kernel_calls_that_xla_runs_at_once_finish():
    """Seen hanging every time (timeout) when a kernel call waited for its own pool tasks
    to start, before kvjax/cpu/split.h; about 5 seconds with it."""
    out = subprocess.run([sys.executable, "-c", _CONCURRENT_CALLS], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "finished", out.stderr[-2000:]


@needs_kernel
def test_one_layer_of_a_stack_is_that_layer_s_product_read_in_place():
    """`product(x, stack, layer=l)` gives the bits of `product(x, stack[l])`, the layer given
    as an int or traced inside a loop over layers; the loop copies no layer's weights out
    of the stack (its compiled temporaries stay below one layer's kernel, where slicing the
    stack would copy a whole kernel per layer). Layer 3 of 3 is refused."""
    i, o, layers = 576, 192, 3
    stack = jnp.stack([pack(jnp.asarray(_weights(i, o, seed))) for seed in range(layers)])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, i)).astype(np.float32))
    each = [np.asarray(product(x, stack[layer])) for layer in range(layers)]
    for layer in range(layers):
        np.testing.assert_array_equal(np.asarray(product(x, stack, layer=layer)), each[layer])

    def loop(x, stack):  # every layer's product of the same rows, by a traced index
        def body(layer, out):
            return out.at[layer].set(product(x, stack, layer=layer))
        return jax.lax.fori_loop(0, layers, body, jnp.zeros((layers, 5, o), jnp.float32))

    compiled = jax.jit(loop).lower(x, stack).compile()
    np.testing.assert_array_equal(np.asarray(compiled(x, stack)), np.stack(each))
    assert compiled.memory_analysis().temp_size_in_bytes < i * o * 4
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(product(x, stack, layer=layers))
