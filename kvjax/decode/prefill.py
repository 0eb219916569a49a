"""Chunked prefill of one sequence: the only way tokens enter a cache outside decode/verify.

Every prefill call has the one fixed shape [1, prefill_chunk], so a token's K/V do not
depend on where its chunk started (the bitwise contract prefix reuse and rollback rely on).
"""

from __future__ import annotations

import jax
import numpy as np

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table


def prefill(params, config: ModelConfig, cache: PagedKVCache, cache_config: CacheConfig,
            tokens: list[int], pages: list[int], start: int = 0, position_base: int = 0,
            lora: dict | None = None, adapter_index: int | None = None,
            sharding=None) -> tuple[jax.Array | None, PagedKVCache]:
    """Writes tokens[start:] into `pages`; returns (last token's logits [V] or None, cache).

    Donates `cache` (through `steps.extend`; `sharding` as there).
    """
    chunk = cache_config.prefill_chunk
    table = page_table([pages], 1, cache_config.block_pages)
    offset = np.array([position_base], np.int32) if position_base else None
    ids = np.array([adapter_index], np.int32) if lora is not None else None
    logits = None
    for s in range(start, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(piece)] = piece
        batch = BatchInfo(page_table=table, lengths=np.array([s], np.int32),
                          num_new=np.array([len(piece)], np.int32), position_offset=offset)
        logits, cache = steps.extend(params, config, cache, padded, batch, lora, ids,
                                     last_only=True, sharding=sharding)
    return (None if logits is None else logits[0, 0]), cache
