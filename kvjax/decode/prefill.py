"""Chunked prefill: the only way tokens enter a cache outside decode/verify.

Every call has the fixed chunk length `prefill_chunk`, so under fast numerics a token's
K/V do not depend on where its chunk started (the contract prefix reuse there relies on),
provided each call holds one sequence. Under an invariant plan a token's bits do not
depend on the call's other rows either, so `prefill_rows` prefills several sequences
together: call c holds chunk c of every sequence, [B, chunk] with B bucketed.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import bucket, page_table
from kvjax.model.plan import FAST, NumericsPlan


@dataclasses.dataclass
class PrefillRow:
    """One sequence to prefill: tokens[start:] go into `pages` (its whole page list)."""

    tokens: list[int]
    pages: list[int]
    start: int = 0
    position_base: int = 0
    adapter_index: int = 0
    open_row: int | None = None  # int4_kivi pages: its slot's open page (kvjax.cache.kivi)
    # an EAGLE head's row (`kvjax.speculative.eagle_engine`): the context's last feature
    # [D] once its prefill is done, the root pair's
    feature: np.ndarray | None = None


def prefill_rows(params, config: ModelConfig, cache: PagedKVCache, cache_config: CacheConfig,
                 rows: list[PrefillRow], lora: dict | None = None, sharding=None,
                 calls: int | None = None, width: int | None = None,
                 plan: NumericsPlan = FAST, min_pages: int = 1, features: bool = False
                 ) -> tuple[list[np.ndarray | None], PagedKVCache]:
    """Prefills every row's tokens[start:] (or its first `calls` chunks); returns (each
    row's last token logits [V], or None when its last token was not in these calls, and
    the cache). Donates `cache` (through `steps.extend`; `sharding` as there). The rows are
    padded to a power of two; a row whose tokens are done rides along with no new token
    (it writes and attends nothing). `width`: tokens per row per call (default the cache's
    chunk; another width changes a token's bits unless `plan` is invariant). `min_pages`:
    the page table's least width (`EngineConfig.min_context`). `features` (one call,
    `calls=1`): (logits, cache, the final norm's output [B, chunk, D] at each row's new
    tokens: what an EAGLE-style head reads)."""
    if features and calls != 1:
        raise ValueError("prefill_rows returns features of one call (calls=1)")
    chunk, n = width or cache_config.prefill_chunk, len(rows)
    b = bucket(n)
    table = page_table([r.pages for r in rows], b, cache_config.block_pages, min_pages)
    offsets = None
    if any(r.position_base for r in rows):
        offsets = np.zeros(b, np.int32)
        offsets[:n] = [r.position_base for r in rows]
    ids = None
    if lora is not None:
        ids = np.zeros(b, np.int32)
        ids[:n] = [r.adapter_index for r in rows]
    needed = max(-(-(len(r.tokens) - r.start) // chunk) for r in rows)
    calls = needed if calls is None else min(calls, needed)
    out: list[jax.Array | None] = [None] * n
    feats = None
    for c in range(calls):
        tokens = np.zeros((b, chunk), np.int32)
        lengths, num_new = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            s = min(r.start + c * chunk, len(r.tokens))
            piece = r.tokens[s:s + chunk]
            tokens[i, : len(piece)] = piece
            lengths[i], num_new[i] = s, len(piece)
        batch = BatchInfo(page_table=table, lengths=lengths, num_new=num_new,
                          position_offset=offsets, open_rows=prefill_open_rows(cache, rows, b))
        logits, cache = steps.extend(params, config, cache, tokens, batch, lora, ids,
                                     last_only=True, sharding=sharding, plan=plan,
                                     features=features)
        if features:
            logits, feats = logits
        logits = np.asarray(logits)  # rows read on the host: no device op per row shape
        for i, r in enumerate(rows):
            if num_new[i] and lengths[i] + num_new[i] == len(r.tokens):
                out[i] = logits[i, 0]
    return (out, cache, feats) if features else (out, cache)


def open_rows(cache: PagedKVCache, of_row: dict[int, int], b: int) -> np.ndarray | None:
    """int4_kivi pages: the open page of each of `b` rows (`of_row`: row -> open page; the
    other rows past the last, so that nothing of theirs is written); None for other
    formats."""
    if cache.open_k is None:
        return None
    out = np.full(b, cache.open_k.shape[2], np.int32)
    for row, page in of_row.items():
        out[row] = page
    return out


def prefill_open_rows(cache: PagedKVCache, rows: list[PrefillRow], b: int
                      ) -> np.ndarray | None:
    """`open_rows` of prefill rows, each of which must name its open page."""
    if cache.open_k is not None and any(r.open_row is None for r in rows):
        raise ValueError("int4_kivi pages: every prefilled row names its open page (open_row)")
    return open_rows(cache, {i: r.open_row for i, r in enumerate(rows)}, b)


def prefill(params, config: ModelConfig, cache: PagedKVCache, cache_config: CacheConfig,
            tokens: list[int], pages: list[int], start: int = 0, position_base: int = 0,
            lora: dict | None = None, adapter_index: int | None = None,
            sharding=None, plan: NumericsPlan = FAST, min_pages: int = 1
            ) -> tuple[jax.Array | None, PagedKVCache]:
    """Writes tokens[start:] of one sequence into `pages`; returns (last token's logits [V]
    or None, cache). Donates `cache` (through `steps.extend`; `sharding`, `plan` and
    `min_pages` as in `prefill_rows`)."""
    row = PrefillRow(list(tokens), list(pages), start, position_base, adapter_index or 0)
    (logits,), cache = prefill_rows(params, config, cache, cache_config, [row], lora, sharding,
                                    plan=plan, min_pages=min_pages)
    return logits, cache
