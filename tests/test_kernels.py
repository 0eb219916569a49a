"""The Pallas paged-attention kernels (interpret mode on CPU) against the reference, and the
backend switch.

Tolerance: `KERNEL_TOL` of the queries' dtype, absolute, about 10x the max abs error measured
over three seeds on outputs up to ~3: float32 9.5e-7 for both kernels, bfloat16 1.6e-2 (one
bfloat16 step at 2; the reference itself accumulates in bfloat16). The TPU kernel rounds K/V
to bfloat16, so it is checked on bfloat16 caches, the one case `resolve_backend` lets it run.
Interpret mode checks the algorithm, not the hardware's arithmetic; lowering for CUDA and TPU
(no device needed) checks the hardware's shape rules.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sharp_params, small_model, tol
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.config import CacheConfig
from kvjax.decode.batching import page_table, pages_for
from kvjax.model import kernels
from kvjax.model.attention import paged_attention_reference
from kvjax.model.kernels import gpu_tiling, paged_decode_attention, resolve_backend

# Keys cached before the step and new tokens per row: ends 1, 7, 33, 60; an inactive decode
# slot (num_new 0: it attends to its 20 cached keys) and an empty one (no keys: output 0).
LENGTHS = [0, 6, 32, 59, 20, 0]
NUM_NEW = [1, 1, 1, 1, 0, 0]
KERNEL_TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 0.16}


def decode_case(num_heads, num_kv_heads, head_dim, page_size, block_pages, q_dtype,
                cache_dtype, seed=0):
    """(q [B, 1, N, H], cache with 2 layers, batch): random pages in a shuffled pool, and
    random values in every slot, written or not (page 0, the table's padding, included)."""
    rng = np.random.default_rng(seed)
    ends = [n + t for n, t in zip(LENGTHS, NUM_NEW, strict=True)]
    counts = [pages_for(e, page_size) for e in ends]
    num_pages = sum(counts) + 5
    ids = iter(rng.permutation(num_pages).tolist())
    rows = [[next(ids) for _ in range(c)] for c in counts]
    shape = (2, num_kv_heads, num_pages, page_size, head_dim)
    cache = PagedKVCache(k=jnp.asarray(rng.standard_normal(shape), cache_dtype),
                         v=jnp.asarray(rng.standard_normal(shape), cache_dtype),
                         block_pages=block_pages)
    batch = BatchInfo(page_table=jnp.asarray(page_table(rows, len(rows), block_pages)),
                      lengths=jnp.asarray(LENGTHS, jnp.int32),
                      num_new=jnp.asarray(NUM_NEW, jnp.int32))
    q = jnp.asarray(rng.standard_normal((len(rows), 1, num_heads, head_dim)), q_dtype)
    return q, cache, batch


def check(backend, q, cache, batch, scale=None):
    """Asserts the kernel matches the reference on layer 1."""
    # finished before the next dispatch: an interpreted kernel's callbacks dispatch JAX ops
    # of their own, and a concurrent eager dispatch from here deadlocked them (seen once)
    out = jax.block_until_ready(
        paged_decode_attention(q, cache, 1, batch, backend, interpret=True, scale=scale))
    ref = paged_attention_reference(q, cache, 1, batch, None, scale=scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out, ref, atol=KERNEL_TOL[q.dtype], rtol=0)
    np.testing.assert_array_equal(out[-1], 0)  # the row with no keys


@pytest.mark.parametrize(("heads", "kv_heads", "page_size", "block_pages", "q_dtype",
                          "cache_dtype"), [
    (4, 4, 4, 1, jnp.float32, jnp.float32),  # MHA
    (8, 2, 8, 2, jnp.float32, jnp.float32),  # GQA
    (4, 1, 16, 4, jnp.float32, jnp.bfloat16),  # MQA, float32 model over a bfloat16 cache
    (8, 2, 8, 2, jnp.bfloat16, jnp.bfloat16),  # GQA in bfloat16
], ids=["mha-p4", "gqa-p8", "mqa-p16-bf16cache", "gqa-p8-bf16"])
def test_gpu_kernel_matches_reference(heads, kv_heads, page_size, block_pages, q_dtype,
                                      cache_dtype):
    q, cache, batch = decode_case(heads, kv_heads, 16, page_size, block_pages, q_dtype,
                                  cache_dtype)
    check("pallas_gpu", q, cache, batch)


def test_kernels_take_the_models_query_scale():
    """Gemma's query_pre_attn_scalar: kvjax scales q before either kernel, as the reference
    does, so a model's own scale needs no fallback."""
    q, cache, batch = decode_case(8, 2, 16, 8, 2, jnp.float32, jnp.float32)
    check("pallas_gpu", q, cache, batch, scale=0.6)
    q, cache, batch = decode_case(8, 2, 128, 16, 2, jnp.float32, jnp.bfloat16)
    check("pallas_tpu", q, cache, batch, scale=0.05)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (8, 1)], ids=["gqa", "mqa"])
def test_tpu_kernel_matches_reference_on_a_bfloat16_cache(heads, kv_heads):
    # G = 4 and G = 8 take the kernel's two query layouts (G % 8 != 0 is relaid as float32).
    q, cache, batch = decode_case(heads, kv_heads, 128, 16, 2, jnp.float32, jnp.bfloat16)
    check("pallas_tpu", q, cache, batch)


def test_tpu_kernel_rounds_a_float32_cache_to_bfloat16():
    """Why a float32 cache falls back: the kernel equals the reference over K/V rounded to
    bfloat16, not over the cache itself."""
    q, cache, batch = decode_case(8, 2, 128, 16, 2, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="rounds K/V to bfloat16"):
        paged_decode_attention(q, cache, 1, batch, "pallas_tpu", interpret=True)
    with pltpu.force_tpu_interpret_mode():
        out = kernels.tpu_kernel.paged_attention(
            q[:, 0] * 128**-0.5, cache.k[1], cache.v[1], batch.lengths + batch.num_new,
            batch.page_table, pages_per_compute_block=2)[:, None]
        out = jax.block_until_ready(out)  # see `check`
    rounded = cache.replace(k=cache.k.astype(jnp.bfloat16).astype(jnp.float32),
                            v=cache.v.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(out, paged_attention_reference(q, rounded, 1, batch, None),
                               atol=KERNEL_TOL[jnp.dtype(jnp.float32)], rtol=0)  # 3.6e-7
    exact = paged_attention_reference(q, cache, 1, batch, None)
    assert np.abs(np.asarray(out) - np.asarray(exact)).max() > 1e-3  # measured 7.8e-3


def test_gpu_kernel_leaks_a_poisoned_unwritten_slot():
    """Why poison_freed falls back: a NaN in the unwritten tail of a row's last page reaches
    the kernel's output (masked weight 0 times NaN), while the reference zeroes it."""
    q, cache, batch = decode_case(4, 1, 16, 16, 4, jnp.float32, jnp.bfloat16)
    last_page = batch.page_table[1, 0]  # row 1 holds 7 of its page's 16 slots
    cache = cache.replace(v=cache.v.at[:, :, last_page, 7:].set(jnp.nan))
    out = jax.block_until_ready(
        paged_decode_attention(q, cache, 1, batch, "pallas_gpu", interpret=True))  # see `check`
    ref = paged_attention_reference(q, cache, 1, batch, None)
    assert np.isfinite(np.asarray(ref)).all()
    assert np.isnan(np.asarray(out[1])).all()


def lowered(fn, platform, *args) -> str:
    """`fn` lowered for `platform` (no such device needed): the kernels' lowerings check the
    hardware's shape rules, which interpret mode does not."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_gpu_path_lowers_for_cuda(page_size):
    for block_pages in (1, 3):
        q, cache, batch = decode_case(8, 2, 16, page_size, block_pages, jnp.float32,
                                      jnp.float32)
        text = lowered(lambda q, c, b: paged_decode_attention(q, c, 1, b, "pallas_gpu"),
                       "cuda", q, cache, batch)
        assert "triton" in text


def test_tpu_path_lowers_for_tpu():
    q, cache, batch = decode_case(8, 2, 128, 16, 2, jnp.float32, jnp.bfloat16)
    text = lowered(lambda q, c, b: paged_decode_attention(q, c, 1, b, "pallas_tpu"),
                   "tpu", q, cache, batch)
    assert "tpu_custom_call" in text


def test_head_dim_limits_are_the_lowerings():
    """The head_dim limits `kernel_limits` states are where the raw kernels stop lowering."""
    def raw(kernel, q, c, b):
        end = b.lengths + b.num_new
        if kernel is kernels.gpu_kernel:
            return kernel.paged_attention(q[:, 0], c.k[1], c.v[1], b.page_table, end,
                                          pages_per_compute_block=1, k_splits=1)
        return kernel.paged_attention(q[:, 0], c.k[1], c.v[1], end, b.page_table,
                                      pages_per_compute_block=2)

    for backend, kernel, platform, head_dim, error in [
            ("pallas_gpu", kernels.gpu_kernel, "cuda", 24, "power of 2"),
            ("pallas_tpu", kernels.tpu_kernel, "tpu", 64, "divisible by 8 and 128")]:
        assert kernels.kernel_limits(backend, head_dim=head_dim)
        q, cache, batch = decode_case(8, 2, head_dim, 16, 2, jnp.float32, jnp.bfloat16)
        with pytest.raises(ValueError, match=error):
            lowered(lambda q, c, b, k=kernel: raw(k, q, c, b), platform, q, cache, batch)


def test_gpu_tiling_fits_the_kernel():
    for page_size in (1, 2, 4, 8, 16, 32, 64):
        for block_pages in (1, 2, 3, 4, 6, 8):
            for width in (2, 4, 6, 8, 12, 16, 64, 256):
                pages, splits, padded = gpu_tiling(page_size, block_pages, width)
                block = pages * page_size
                assert block >= 16 and block & (block - 1) == 0, (page_size, block_pages)
                assert pages <= max(block_pages, -(-16 // page_size))
                assert padded >= width and padded % (pages * splits) == 0
                assert 1 <= splits <= 16 and padded - width < pages


def test_sharded_decode_on_a_one_device_mesh_matches_unsharded():
    q, cache, batch = decode_case(8, 2, 16, 8, 2, jnp.float32, jnp.float32)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    out = kernels.sharded_paged_decode_attention(
        q, cache, 1, batch, "pallas_gpu", mesh=mesh,
        cache_spec=PartitionSpec(None, "model"), interpret=True)
    out = jax.block_until_ready(out)  # see `check`
    expected = paged_decode_attention(q, cache, 1, batch, "pallas_gpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.fixture
def fresh_warnings(monkeypatch):
    """`resolve_backend` warns once per reason per process; each test starts afresh."""
    monkeypatch.setattr(kernels, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_auto_picks_by_platform(fresh_warnings):
    gpu_model = small_model(d_model=64, num_heads=4)  # head_dim 16
    tpu_model = small_model(d_model=512, num_heads=4, num_kv_heads=2)  # head_dim 128
    bf16 = CacheConfig(page_size=16, dtype="bfloat16")
    assert resolve_backend("auto", gpu_model, "cpu") == "reference"
    assert resolve_backend("auto", gpu_model, "gpu", cache=CacheConfig()) == "pallas_gpu"
    assert resolve_backend("auto", tpu_model, "tpu", cache=bf16) == "pallas_tpu"
    assert resolve_backend("pallas_gpu", gpu_model, "cpu") == "pallas_gpu"  # explicit: kept
    assert resolve_backend("reference", gpu_model, "gpu") == "reference"
    assert resolve_backend("auto", gpu_model) == resolve_backend("auto", gpu_model,
                                                                 jax.default_backend())
    assert fresh_warnings == []


def test_sliding_window_falls_back_and_warns_once(fresh_warnings):
    windowed = small_model(d_model=64, num_heads=4, sliding_window=8)
    for _ in range(3):
        assert resolve_backend("pallas_gpu", windowed, "gpu") == "reference"
        assert resolve_backend("auto", windowed, "gpu") == "reference"
    assert len(fresh_warnings) == 1
    assert "sliding window" in str(fresh_warnings[0].message)


@pytest.mark.parametrize(("backend", "model", "cache", "poison", "reason"), [
    ("pallas_gpu", dict(d_model=96, num_heads=4), None, False, "head_dim a power of two"),
    ("pallas_gpu", dict(d_model=64, num_heads=4), CacheConfig(page_size=12, prefill_chunk=48,
                                                 attn_block=48),
     False, "page_size a power of two"),
    ("pallas_gpu", dict(d_model=64, num_heads=4), None, True, "poison"),
    ("pallas_tpu", dict(d_model=512, num_heads=4), CacheConfig(), False, "rounds K/V"),
    ("pallas_tpu", dict(d_model=256, num_heads=4), None, False, "multiple of 128"),
    ("pallas_tpu", dict(d_model=512, num_heads=4),
     CacheConfig(page_size=8, dtype="bfloat16", prefill_chunk=64), False, "multiple of 16"),
    ("pallas_gpu", dict(d_model=64, num_heads=4, attn_softcap=50.0), None, False,
     "soft-capping"),
    ("pallas_gpu", dict(d_model=64, num_heads=4, sliding_window=8,
                        layer_types=("full", "sliding")), None, False, "sliding window"),
], ids=["gpu-head-dim", "gpu-page-size", "gpu-poison", "tpu-float32-cache", "tpu-head-dim",
        "tpu-page-size", "gpu-softcap", "gpu-layer-windows"])
def test_unsupported_shapes_fall_back(fresh_warnings, backend, model, cache, poison, reason):
    config = small_model(**model)
    assert resolve_backend(backend, config, cache=cache, poison_freed=poison) == "reference"
    assert resolve_backend(backend, config, cache=cache, poison_freed=poison) == "reference"
    assert len(fresh_warnings) == 1 and reason in str(fresh_warnings[0].message)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'auto', 'reference', 'pallas_gpu', 'pallas_tpu'"):
        resolve_backend("triton", small_model())


def test_kernel_refuses_what_it_cannot_compute():
    q, cache, batch = decode_case(8, 2, 16, 8, 2, jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="sliding window"):
        paged_decode_attention(q, cache, 1, batch, "pallas_gpu", interpret=True, window=4)
    with pytest.raises(ValueError, match="soft-capping"):
        paged_decode_attention(q, cache, 1, batch, "pallas_gpu", interpret=True, softcap=9.0)
    with pytest.raises(ValueError, match="one token per row"):
        paged_decode_attention(jnp.concatenate([q, q], axis=1), cache, 1, batch, "pallas_gpu")


def test_engine_decodes_with_the_gpu_kernel_as_with_the_reference(swapped):
    """The whole engine with `attention="pallas_gpu"` (interpret mode) under fast numerics,
    where the kernels run: the decode loop traces the kernel, same greedy tokens, logits
    within float32 tolerance of the reference attention. Invariant numerics attend by the
    reference, per query, and never call it."""
    import dataclasses

    from kvjax import Engine, EngineConfig, Request
    from kvjax.model import transformer

    calls = []
    kernel = transformer.paged_decode_attention
    swapped(transformer, "paged_decode_attention",  # kvjax's kept programs off meanwhile
            lambda *a, **k: calls.append(a[4]) or kernel(*a, **k))
    config = small_model(vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2,
                         max_seq_len=256)  # head_dim 16: the GPU kernel's least
    params = sharp_params(config, seed=2)
    ec = EngineConfig(cache=CacheConfig(page_size=8, num_pages=64, prefill_chunk=32,
                                        attn_block=16), max_slots=4, decode_steps=8,
                      numerics="fast", cpu_kernel="off")  # XLA's attention, the reference
    requests = [Request(list(range(1, 10 + 9 * i)), max_new_tokens=10, return_logits=True)
                for i in range(4)]
    want = Engine(params, config, ec).generate(requests)
    assert calls == []
    engine = Engine(params, config, dataclasses.replace(ec, attention="pallas_gpu",
                                                        attention_interpret=True))
    assert engine.attention == "pallas_gpu"
    got = engine.generate(requests)
    assert calls and set(calls) == {"pallas_gpu"}  # traced once per layer
    for a, b in zip(want, got, strict=True):
        assert a.tokens == b.tokens
        err = np.abs(np.asarray(a.logits) - np.asarray(b.logits)).max()
        assert err <= tol(9.3e-6)
    calls.clear()
    invariant = Engine(params, config, dataclasses.replace(
        ec, numerics="invariant", attention="pallas_gpu", attention_interpret=True))
    assert invariant.generate(requests[:1])[0].tokens == want[0].tokens
    assert calls == []
