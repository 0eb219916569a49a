"""Quantized pages (`CacheConfig(dtype="int8")` or `"float8_e4m3fn"`, `kvjax.cache.paged`):
each token's K and V of a KV head stored as int8 or e4m3 numbers with one float32 scale,
quantized at write from that token alone. What they change is exactly the stored numbers:
attention over them equals attention over float pages holding the dequantized numbers,
bitwise; the engine keeps every exact promise under each format (cache on == off, a
request's alone bits, poisoned pages never read); the format is part of the cache identity;
the bytes are what the calculator says."""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_same, engine, params, with_cache
from helpers import random_tokens

from kvjax import Request
from kvjax.cache.paged import (
    DTYPES,
    BatchInfo,
    cache_bytes,
    dequantize,
    init_cache,
    quantize,
    write_kv,
)
from kvjax.cpu.product import kernel
from kvjax.memory.calculator import KV_FORMATS, kv_bytes, kv_bytes_per_scalar
from kvjax.model.attention import paged_attention_reference
from kvjax.model.kernels import kernel_limits, resolve_backend

INT8 = with_cache(dtype="int8")
FORMATS = ["int8", "float8_e4m3fn"]


def test_each_vector_rounds_to_within_half_a_step_of_its_own_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * np.float32([[1e-3], [1], [1e4]])
    x[0, 0] = 0.0  # an all-zero vector: scale 0, zeros back
    q, scale = quantize(jnp.asarray(x))
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and scale.shape == (5, 3) and scale[0, 0] == 0
    np.testing.assert_array_equal(np.abs(q).max(-1)[scale > 0], 127)  # the largest: +-127
    back = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(scale), jnp.float32))
    step = scale[..., None]
    assert (np.abs(back - x) <= step * (0.5 + 1e-6)).all()
    assert not (back == x).all()


def test_each_float8_number_is_its_vectors_scaled_value_rounded_to_e4m3():
    """e4m3 with a scale per vector: the largest magnitude becomes +-448 (e4m3's largest,
    no NaN from values past it), every number is ml_dtypes' round-to-nearest-even of x /
    scale, so it is within half an e4m3 step (2^-4 of its power of two) of x."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * np.float32([[1e-3], [1], [1e4]])
    x[0, 0] = 0.0
    q, scale = quantize(jnp.asarray(x), jnp.float8_e4m3fn)
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale[0, 0] == 0
    assert np.isfinite(q.astype(np.float32)).all()
    np.testing.assert_array_equal(np.abs(q.astype(np.float32)).max(-1)[scale > 0], 448)
    safe = np.where(scale > 0, scale, 1)[..., None]
    want = np.clip(x / safe, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
    back = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(scale), jnp.float32))
    rel = np.abs(back - x) / np.maximum(np.abs(x), 2.0 ** -6 * safe)  # e4m3 subnormals
    assert rel.max() <= 2.0 ** -4 * (1 + 1e-6) and not (back == x).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_over_quantized_pages_is_attention_over_their_numbers(fmt):
    """Both pools written by `write_kv`, the float one with the dequantized K/V: every
    output bitwise equal, prefill-shaped and decode-shaped queries, rows of other lengths."""
    rng = np.random.default_rng(1)
    k_, h = CONFIG.num_kv_heads, CONFIG.head_dim
    k = jnp.asarray(rng.standard_normal((2, 12, k_, h)), jnp.float32) * 3
    v = jnp.asarray(rng.standard_normal((2, 12, k_, h)), jnp.float32)
    table = jnp.asarray([[3, 7, 1, 0], [5, 2, 6, 4]], jnp.int32)
    batch = BatchInfo(page_table=table, lengths=jnp.zeros(2, jnp.int32),
                      num_new=jnp.asarray([12, 9], jnp.int32))
    quantized = write_kv(init_cache(CONFIG, with_cache(dtype=fmt)), 0, k, v, batch)
    kq, ks = quantize(k, DTYPES[fmt])
    vq, vs = quantize(v, DTYPES[fmt])
    plain = write_kv(init_cache(CONFIG, CACHE), 0, dequantize(kq, ks, jnp.float32),
                     dequantize(vq, vs, jnp.float32), batch)
    q = jnp.asarray(rng.standard_normal((2, 12, CONFIG.num_heads, h)), jnp.float32)
    for t, lengths in ((12, [0, 0]), (1, [11, 8])):
        b = dataclasses.replace(batch, lengths=jnp.asarray(lengths, jnp.int32),
                                num_new=jnp.asarray([t, t], jnp.int32))
        args = (q[:, :t], 0, b, None)
        got = np.asarray(paged_attention_reference(args[0], quantized, *args[1:]))
        want = np.asarray(paged_attention_reference(args[0], plain, *args[1:]))
        np.testing.assert_array_equal(got, want)
        full = write_kv(init_cache(CONFIG, CACHE), 0, k, v, batch)
        exact = np.asarray(paged_attention_reference(args[0], full, *args[1:]))
        # against float32 pages: measured int8 0.023, e4m3 0.12 (outputs up to 3.1)
        assert 0 < np.abs(got - exact).max() < {"int8": 0.25, "float8_e4m3fn": 1.2}[fmt]


@pytest.mark.parametrize("fmt", ["bfloat16", "float8_e4m3fn"])
def test_a_page_write_converts_no_more_than_the_new_tokens(fmt):
    """XLA:CPU writes into a bfloat16 or float8 array by converting the whole array to a
    wider float and back; pages of those formats hold their bits on CPU, so a compiled
    write converts nothing the pool's size, and reads give back the written numbers.
    (Seen failing with the pages stored as numbers: two converts of the whole pool.)"""
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((2, 3, CONFIG.num_kv_heads, CONFIG.head_dim)),
                    jnp.float32)
    batch = BatchInfo(page_table=jnp.asarray([[3, 1], [5, 2]], jnp.int32),
                      lengths=jnp.zeros(2, jnp.int32), num_new=jnp.asarray([3, 2], jnp.int32))
    cache = init_cache(CONFIG, with_cache(dtype=fmt))
    text = jax.jit(write_kv, static_argnums=1).lower(cache, 0, k, k, batch).compile().as_text()
    converted = [int(np.prod([int(d) for d in m.group(1).split(",") if d]))
                 for m in re.finditer(r"= \w+\[([\d,]*)\]\S* convert\(", text)]
    assert converted and max(converted) <= k.size  # the new tokens' K (or V), no more
    cache = write_kv(cache, 0, k, k * 0.5, batch)
    written = cache.read(cache.k)[0, :, 3, :3].transpose(1, 0, 2)  # [3, K, H] of row 0
    if fmt == "bfloat16":
        np.testing.assert_array_equal(written, k[0].astype(jnp.bfloat16))
    else:
        kq, _ = quantize(k[0], jnp.float8_e4m3fn)
        np.testing.assert_array_equal(written.view(jnp.uint8), kq.view(jnp.uint8))


def _requests():
    system = random_tokens(3, [22], CONFIG.vocab_size)[0]
    tails = random_tokens(4, [3, 6, 5], CONFIG.vocab_size)
    return [Request(tokens=system + t, max_new_tokens=8, return_logits=True) for t in tails]


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.mark.parametrize("fmt", [*FORMATS, "int4_kivi"])
def test_cache_on_equals_off_and_each_request_gets_its_alone_bits(p, fmt):
    """Under quantized pages (int4_kivi's too, tests/test_kivi_pages.py): requests that reuse
    a shared prompt's pages (and pages written by decoding) get the bits of a cache-off
    engine, and of each request run alone."""
    fmt_cache = with_cache(dtype=fmt)
    on = engine(p, cache=fmt_cache)
    first = on.generate(_requests()[:1])
    rest = on.generate(_requests()[1:])
    assert all(r.stats["reused_tokens"] >= 20 for r in rest)
    off = engine(p, cache=fmt_cache, prefix_cache=False).generate(_requests())
    assert_same(first + rest, off)
    alone = engine(p, cache=fmt_cache, max_slots=1, prefix_cache=False)
    assert_same([alone.generate([r])[0] for r in _requests()], off)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_pages_change_the_logits_by_their_rounding_only(p, fmt):
    """Against float32 pages: close (the rounding of K/V), not equal (they are quantized)."""
    got = engine(p, cache=with_cache(dtype=fmt), prefix_cache=False).generate(_requests())
    ref = engine(p, prefix_cache=False).generate(_requests())
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        n = min(len(a.tokens), len(b.tokens))
        k = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n) + 1  # same history
        worst = max(worst, float(np.abs(np.asarray(a.logits[:k]) - np.asarray(b.logits[:k]))
                                 .max()))
    # measured over the 3 x 8 steps, logits up to 9.5 (the tests' sharp weights): int8 0.24,
    # e4m3 1.38 (its greedy tokens part from float32 pages' after 16 of 24; int8's never)
    assert 0 < worst < {"int8": 2.5, "float8_e4m3fn": 14.0}[fmt], worst


def test_poisoned_freed_int8_pages_are_never_read(p):
    """`poison_freed` fills a freed int8 page's scales with NaN (an int8 has no NaN): with
    10 pages, evictions and preemptions, outputs equal an unpoisoned engine's."""
    cache = with_cache(INT8, num_pages=10)
    poisoned = engine(p, cache=cache, poison_freed=True, max_slots=2)
    assert_same(poisoned.generate(_requests()), engine(p, cache=cache, max_slots=2)
                .generate(_requests()))
    m = poisoned.metrics()
    assert m["evictions"] > 0 and m["preemptions"] > 0  # freed pages taken again


def test_the_format_is_part_of_the_cache_identity(p):
    r = _requests()[0]
    # XLA's attention for every format ("products"): the format alone differs
    same = dict(cpu_kernel="products")
    assert engine(p, cache=INT8, **same).namespace(r).differing_fields(
        engine(p, **same).namespace(r)) == ["kv_dtype"]
    float8 = engine(p, cache=with_cache(dtype="float8_e4m3fn"))
    assert float8.namespace(r).differing_fields(engine(p, cache=INT8).namespace(r)) == [
        "kv_dtype"]  # the same bytes per number, other numbers
    # by default float32 pages take the attention kernel where it runs, int8 pages never:
    # the plans (so the model fingerprints) differ there too
    differ = ["model", "kv_dtype"] if kernel().available else ["kv_dtype"]
    assert engine(p, cache=INT8).namespace(r).differing_fields(
        engine(p).namespace(r)) == differ


def test_the_calculator_counts_the_bytes_the_pool_allocates():
    assert list(KV_FORMATS) == list(DTYPES)  # the calculator knows every format
    for dtype in DTYPES:  # and CacheConfig takes each (its own list of choices)
        assert with_cache(dtype=dtype).dtype == dtype
    for dtype in FORMATS + ["float32", "bfloat16"]:  # int4_kivi: tests/test_kivi_pages.py
        cc = with_cache(dtype=dtype)
        per_token = kv_bytes(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, 1, 1,
                             kv_bytes_per_scalar(dtype, CONFIG.head_dim))
        assert cache_bytes(init_cache(CONFIG, cc)) == cc.num_pages * cc.page_size * per_token
    h = 64  # SmolLM2's head_dim: 4 * 64 / (64 + 4) tokens per byte of float32 pages
    assert kv_bytes_per_scalar("float32", h) / kv_bytes_per_scalar("int8", h) == 256 / 68


def test_kernels_fall_back_and_other_holders_refuse(p):
    for backend in ("pallas_gpu", "pallas_tpu"):
        for fmt in FORMATS:
            reasons = kernel_limits(backend, head_dim=128, page_size=16,
                                    cache_dtype=DTYPES[fmt])
            assert reasons == [f"{backend} reads float pages; {fmt} pages (a scale per token "
                               f"and KV head) are dequantized by the reference"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said once per reason per process
        assert resolve_backend("pallas_gpu", CONFIG, "gpu", cache=INT8) == "reference"
    from kvjax.cache.dense import init_dense_cache

    with pytest.raises(ValueError, match="float32 or bfloat16, not 'int8'"):
        init_dense_cache(CONFIG, 1, 8, "int8")
    with pytest.raises(NotImplementedError, match="int8 pages on a mesh"):
        engine(p, cache=INT8, mesh="data=1,model=1")
    assert jax.devices()  # the refusals above left the process serving
