"""A dense contiguous KV cache, kept only as a baseline for the paged one.

Each batch slot owns `max_len` contiguous positions; there is no sharing and no paging.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import DTYPES, BatchInfo, new_positions
from kvjax.config import ModelConfig


@flax.struct.dataclass
class DenseKVCache:
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]


def init_dense_cache(model: ModelConfig, batch: int, max_len: int,
                     dtype: str = "float32") -> DenseKVCache:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the dense baseline cache holds float32 or bfloat16, not {dtype!r}")
    shape = (model.num_layers, batch, max_len, model.num_kv_heads, model.head_dim)
    return DenseKVCache(k=jnp.zeros(shape, DTYPES[dtype]), v=jnp.zeros(shape, DTYPES[dtype]))


def dense_write_kv(cache: DenseKVCache, layer: int, k: jax.Array, v: jax.Array,
                   batch: BatchInfo) -> DenseKVCache:
    """Writes [B, T, K, H] new K/V at positions `lengths + t`; padded tokens are dropped."""
    positions, valid = new_positions(batch, k.shape[1])
    positions = jnp.where(valid, positions, cache.k.shape[2])  # out of range: dropped
    rows = jnp.arange(k.shape[0])[:, None]
    new_k = cache.k.at[layer, rows, positions].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, rows, positions].set(v.astype(cache.v.dtype), mode="drop")
    return cache.replace(k=new_k, v=new_v)
