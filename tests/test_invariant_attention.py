"""Row-tiled paged attention (`paged_attention_reference(..., row_tile=R)`): a query's
output bits do not depend on how many queries share the call (a prefill chunk, a verify, a
decode step) nor on the other sequences in the batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_reference, small_model

from kvjax import BatchInfo, CacheConfig, init_cache
from kvjax.decode.batching import page_table

TOL = 2e-6  # tiled vs the T * G-row products: measured 1.8e-7 on outputs of std 0.25
TILE = 4  # query rows per product: 16 queries x G = 4 make 16 tiles, one query of G = 1 two rows


def _case(num_heads: int, num_kv_heads: int, seed: int = 0, head_dim: int = 8,
          attn_block: int = 16):
    config = small_model(num_heads=num_heads, num_kv_heads=num_kv_heads, d_model=64,
                         head_dim=head_dim)
    cache_cfg = CacheConfig(page_size=4, num_pages=64, attn_block=attn_block, prefill_chunk=16)
    cache = init_cache(config, cache_cfg)
    rng = np.random.default_rng(seed)
    cache = cache.replace(k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype),
                          v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype))
    rows = [list(range(14)), list(range(14, 30)), list(range(30, 40))]  # 3 sequences
    q = rng.standard_normal((3, 16, num_heads, config.head_dim)).astype(np.float32)
    return cache, rows, jnp.asarray(q), cache_cfg


def _attend(cache, rows, q, block_pages, lengths, num_new, row_tile=TILE, window=None):
    batch = BatchInfo(page_table=jnp.asarray(page_table(rows, len(rows), block_pages)),
                      lengths=jnp.asarray(lengths, jnp.int32),
                      num_new=jnp.asarray(num_new, jnp.int32))
    return np.asarray(attention_reference(q, cache, 0, batch, window, row_tile))


@pytest.mark.parametrize("window", [None, 8, 20])
def test_each_row_of_a_ragged_batch_has_its_bits_alone(window):
    """Rows of very different lengths (a long row's extra blocks, past the shortest row's
    last, run on their own, from its own window's first block under a sliding window):
    every row's output equals the row alone bitwise, and the untiled products within
    float32 rounding."""
    cache, rows, q, cc = _case(8, 2)
    bp = cc.attn_block // cc.page_size
    lengths, num_new = [24, 48, 0], [16, 8, 4]
    batched = _attend(cache, rows, q, bp, lengths, num_new, window=window)
    grouped = _attend(cache, rows, q, bp, lengths, num_new, None, window)
    for r in range(3):
        n = num_new[r]
        alone = _attend(cache, rows[r:r + 1], q[r:r + 1, :n], bp, lengths[r:r + 1], [n],
                        window=window)[0]
        np.testing.assert_array_equal(batched[r, :n], alone)
        np.testing.assert_allclose(batched[r, :n], grouped[r, :n], rtol=0, atol=TOL)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 2)])  # G = 4, 1, 3
def test_a_query_has_the_same_bits_in_any_call(heads, kv_heads):
    cache, rows, q, cc = _case(heads, kv_heads)
    bp = cc.attn_block // cc.page_size
    start = 24  # the 16 queries of sequence 0 sit at positions 24 .. 39
    chunk = _attend(cache, rows[:1], q[:1], bp, [start], [16])[0]  # [T, N, H]
    batched = _attend(cache, rows, q, bp, [start, 40, 20], [16, 16, 16])[0]
    np.testing.assert_array_equal(batched, chunk)
    for t in range(16):  # one query per call, as in decode
        alone = _attend(cache, rows[:1], q[:1, t:t + 1], bp, [start + t], [1])[0, 0]
        np.testing.assert_array_equal(chunk[t], alone)
    for t0, size in [(0, 5), (5, 2), (7, 9)]:  # verify-sized calls
        part = _attend(cache, rows[:1], q[:1, t0:t0 + size], bp, [start + t0], [size])
        np.testing.assert_array_equal(part[0], chunk[t0:t0 + size])
    grouped = _attend(cache, rows[:1], q[:1], bp, [start], [16], None)[0]
    np.testing.assert_allclose(chunk, grouped, rtol=0, atol=TOL)


def test_the_untiled_products_do_change_with_the_number_of_queries():
    """What the tiles fix, seen on this backend: with G = 1 (H = 16), a query alone is a
    one-row product (a matrix-vector kernel), other bits than in a 16-row one; the tiles
    pad it to two rows. (With G >= 2 the untiled products held at every shape tried here;
    T * G = 64 rows split from 32 rows at H = 16, S = 32 in a plain batched product.)"""
    cache, rows, q, cc = _case(4, 4, head_dim=16)
    bp = cc.attn_block // cc.page_size
    chunk = _attend(cache, rows[:1], q[:1], bp, [24], [16], None)[0]
    alone = [_attend(cache, rows[:1], q[:1, t:t + 1], bp, [24 + t], [1], None)[0, 0]
             for t in range(16)]
    assert any(not np.array_equal(chunk[t], alone[t]) for t in range(16))
    tiled = _attend(cache, rows[:1], q[:1], bp, [24], [16])[0]
    for t in range(16):
        np.testing.assert_array_equal(
            tiled[t], _attend(cache, rows[:1], q[:1, t:t + 1], bp, [24 + t], [1])[0, 0])


@pytest.mark.parametrize("new", [1, 3])  # decode, a verify-sized call
def test_rows_of_any_length_share_a_call_with_their_alone_bits(new):
    """Rows whose caches end in different attention blocks (1, 3 and 10 blocks of 16 keys,
    and an idle row with none): every row visits its own blocks (the longest row's extra
    blocks run for it alone), and each keeps the bits it has alone, and the grouped path's
    values (which visits every block of every row)."""
    cache, _, q, cc = _case(8, 2)
    bp = cc.attn_block // cc.page_size
    rows = [[0, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(12, 52)), []]
    lengths, num_new = [5, 40 - new, 158 - new, 0], [new, new, new, 0]
    qs = jnp.concatenate([q, q[:1]])[:, :new]  # [4, new, N, H]
    batched = _attend(cache, rows, qs, bp, lengths, num_new)
    grouped = _attend(cache, rows, qs, bp, lengths, num_new, None)
    for i in range(3):
        alone = _attend(cache, rows[i:i + 1], qs[i:i + 1], bp, lengths[i:i + 1],
                        num_new[i:i + 1])[0]
        np.testing.assert_array_equal(batched[i], alone)
        np.testing.assert_allclose(batched[i], grouped[i], rtol=0, atol=TOL)
