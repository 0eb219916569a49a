"""Paged attention on XLA CPU by kvjax's kernel (kvjax/cpu/attention.cc), called from JAX.

Each query is computed alone, its keys read in place from the pages in ascending position,
every sum in an order fixed by the query's own keys (the C++ file's head gives it), so a
query's bits depend on its own history only: the batch, the chunk, the page table's padding
and the threads change none of them, under fast numerics as under invariant ones. They are
not the bits of XLA's attention (`kvjax.model.attention.paged_attention_reference`): the
kernel in use is part of the numerics plan (`NumericsPlan.cpu_attention`). `reference` is
the same arithmetic in numpy, operation for operation: the kernel's bits are checked
against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.cpu.product import TARGET_ATTENTION as TARGET
from kvjax.cpu.product import kernel

LANES = 16


def unsupported(dtype: str, softcap: float | None = None) -> str | None:
    """Why the kernel cannot run attention over pages of format `dtype`
    (`CacheConfig.dtype`) with scores soft-capped at `softcap` (None: it can): it reads
    float32 and bfloat16 pages, without a soft cap."""
    if dtype not in ("float32", "bfloat16"):
        return f"{dtype} pages"
    if softcap is not None:
        return "soft-capped scores"
    return None


def _format(cache: PagedKVCache) -> str:
    if cache.open_k is not None:
        return "int4_kivi"
    if cache.k_scale is not None:
        return "scaled (int8 or float8_e4m3fn)"
    return jnp.dtype(cache.dtype).name


def paged_attention(q: jax.Array, cache: PagedKVCache, layer, batch: BatchInfo,
                    window: int | None, scale: float | None = None) -> jax.Array:
    """Causal attention of new queries q [B, T, N, H] (at positions `batch.lengths + t`, a
    tree verify's at `lengths + depth`) over the paged cache, which already holds them, as
    `paged_attention_reference` defines it (same keys seen, same window, same tree
    layout) -> float32 [B, T, N, H]; queries t >= num_new are 0. `scale` multiplies the
    queries (None: 1/sqrt(H))."""
    if not kernel().available:
        raise RuntimeError(f"kvjax.cpu.attention: {kernel().describe()}")
    why = unsupported(_format(cache))
    if why:
        raise ValueError(f"kvjax.cpu.attention: the kernel does not read {why}")
    b, h = q.shape[0], q.shape[-1]
    q = (q * jnp.asarray(h**-0.5 if scale is None else scale, q.dtype)).astype(jnp.float32)
    tree = batch.ancestors is not None
    depth = batch.depth if tree else jnp.zeros((b, 1), jnp.int32)
    ancestors = batch.ancestors if tree else jnp.zeros((b, 1, 1), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, cache.k, cache.v, jnp.asarray(layer, jnp.int32).reshape(1),
                batch.page_table.astype(jnp.int32), batch.lengths.astype(jnp.int32),
                batch.num_new.astype(jnp.int32), depth.astype(jnp.int32),
                ancestors.astype(jnp.int32), window=np.int64(window or 0), tree=tree)


# ---- the same arithmetic in numpy ----------------------------------------------------------

_F = np.float32


def tree16(lanes: np.ndarray) -> np.ndarray:
    """[..., 16] -> [...]: halves added (8, 4, 2, 1), as attention.cc's tree16."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def expf(x: np.ndarray) -> np.ndarray:
    """attention.cc's expf_ on float32 x <= 0, operation for operation."""
    x = np.asarray(x, _F)
    n = np.rint(x * _F(1.44269504088896341))
    r = (x - n * _F(0.693359375)) - n * _F(-2.12194440e-4)
    p = np.full_like(r, _F(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        p = p * r + _F(c)
    p = p * (r * r) + r + _F(1.0)
    two = ((np.clip(n, -126, 127).astype(np.int32) + 127) << 23).view(_F)
    return np.where(x >= _F(-87.0), p * two, _F(0.0)).astype(_F)


def _score(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [H] and keys k [S, H] -> [S], lane by lane then tree16."""
    hp = -(-q.shape[-1] // LANES) * LANES
    q = np.pad(q, (0, hp - q.shape[-1])).reshape(-1, LANES)
    k = np.pad(k, ((0, 0), (0, hp - k.shape[-1]))).reshape(k.shape[0], -1, LANES)
    lanes = np.zeros((k.shape[0], LANES), _F)
    for i in range(q.shape[0]):
        lanes = lanes + q[i] * k[:, i]
    return tree16(lanes)


def reference(q, k_pool, v_pool, layer: int, page_table, lengths, num_new, window: int | None,
              scale: float | None = None, depth=None, ancestors=None) -> np.ndarray:
    """What kvjax_attention computes, in numpy float32 (slow; for tests): q [B, T, N, H]
    unscaled, pools [layers, K, pages, page_size, H] float32 (or bfloat16 widened),
    page_table [B, P], lengths, num_new [B]; a tree verify's depth [B, T], ancestors
    [B, T, T]."""
    q, k_pool, v_pool = (np.asarray(a, _F) for a in (q, k_pool, v_pool))
    b_, t_, n, h = q.shape
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[3]
    g_heads = n // kv_heads
    q = q * _F(h**-0.5 if scale is None else scale)
    out = np.zeros(q.shape, _F)
    for b in range(b_):
        length = int(lengths[b])
        for t in range(int(num_new[b])):
            pos = length + (t if depth is None else int(depth[b][t]))
            lo = max(0, pos - window + 1) if window else 0
            p = np.arange(lo, pos + 1)
            slot = p if ancestors is None else np.where(
                p < length, p, length + np.asarray(ancestors[b][t])[np.clip(p - length, 0,
                                                                            t_ - 1)])
            page = np.asarray(page_table[b])[slot // page_size]
            for head in range(n):
                kv = head // g_heads
                keys = k_pool[layer, kv, page, slot % page_size]  # [S, H]
                values = v_pool[layer, kv, page, slot % page_size]
                s = _score(q[b, t, head], keys)
                e = expf(s - s.max())
                lanes = np.zeros(LANES, _F)
                for pos_, e_ in zip(p, e, strict=True):
                    lanes[pos_ % LANES] = lanes[pos_ % LANES] + e_
                acc = np.zeros(h, _F)
                for e_, v in zip(e, values, strict=True):
                    acc = acc + e_ * v
                out[b, t, head] = acc / tree16(lanes)
    return out
