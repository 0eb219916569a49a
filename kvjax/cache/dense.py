"""A dense contiguous KV cache, kept only as a baseline for the paged one.

Each batch slot owns `max_len` contiguous positions; there is no sharing and no paging.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import (
    BITS,
    DTYPES,
    BatchInfo,
    StoredNumbers,
    new_positions,
    stored_as_bits,
)
from kvjax.config import ModelConfig


@flax.struct.dataclass
class DenseKVCache(StoredNumbers):
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    # bfloat16 on CPU: the bits (`kvjax.cache.paged.stored_as_bits`); None: numbers
    numbers: str | None = flax.struct.field(pytree_node=False, default=None)
    k_scale = None  # never quantized


def init_dense_cache(model: ModelConfig, batch: int, max_len: int,
                     dtype: str = "float32") -> DenseKVCache:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the dense baseline cache holds float32 or bfloat16, not {dtype!r}")
    shape = (model.num_layers, batch, max_len, model.num_kv_heads, model.head_dim)
    bits = stored_as_bits(dtype)
    stored = BITS[dtype] if bits else DTYPES[dtype]
    return DenseKVCache(k=jnp.zeros(shape, stored), v=jnp.zeros(shape, stored),
                        numbers=dtype if bits else None)


def dense_write_kv(cache: DenseKVCache, layer: int, k: jax.Array, v: jax.Array,
                   batch: BatchInfo) -> DenseKVCache:
    """Writes [B, T, K, H] new K/V at positions `lengths + t`; padded tokens are dropped."""
    positions, valid = new_positions(batch, k.shape[1])
    positions = jnp.where(valid, positions, cache.k.shape[2])  # out of range: dropped
    rows = jnp.arange(k.shape[0])[:, None]
    new_k = cache.k.at[layer, rows, positions].set(cache.store(k), mode="drop")
    new_v = cache.v.at[layer, rows, positions].set(cache.store(v), mode="drop")
    return cache.replace(k=new_k, v=new_v)
