"""kvjax's paged attention kernel for CPU (kvjax/cpu/attention.cc): its bits are the numpy
reference's (the order of every sum written out), a query's bits are its own whatever the
batch, chunk and page table around it, it sees the keys XLA's attention sees (windows, tree
verifies) with values to rounding, and the pages it cannot read get a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache.paged import BatchInfo, PagedKVCache
from kvjax.cpu import attention
from kvjax.cpu.product import kernel
from kvjax.model.attention import paged_attention_reference
from kvjax.speculative.tree import tree_arrays

pytestmark = pytest.mark.skipif(not kernel().available, reason=kernel().describe())

PS, PAGES, LAYERS = 4, 40, 2
TREE = [-1, 0, 0, 1, 1, 2, 4]


def _pools(h: int, kv: int, dtype=jnp.float32, seed: int = 0):
    """Random K and V pools [LAYERS, kv, PAGES, PS, h] (keys large enough that the softmax
    is far from uniform), and the cache holding them as the engine stores `dtype`."""
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((LAYERS, kv, PAGES, PS, h)) * 2).astype(np.float32)
    v = rng.standard_normal((LAYERS, kv, PAGES, PS, h)).astype(np.float32)
    k, v = (np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32)) for a in (k, v))
    if dtype == jnp.bfloat16:  # on CPU bfloat16 pages hold their bits (kvjax.cache.paged)
        bits = [jax.lax.bitcast_convert_type(jnp.asarray(a, dtype), jnp.uint16) for a in (k, v)]
        return k, v, PagedKVCache(k=bits[0], v=bits[1], block_pages=2, numbers="bfloat16")
    return k, v, PagedKVCache(k=jnp.asarray(k), v=jnp.asarray(v), block_pages=2)


def _poisoned(cache: PagedKVCache, pages) -> PagedKVCache:
    """`cache` with `pages` full of NaN (their bits): pages no query may read."""
    nan = jnp.asarray(np.nan, jnp.float32)
    if cache.numbers:
        nan = jax.lax.bitcast_convert_type(nan.astype(jnp.bfloat16), jnp.uint16)
    idx = np.asarray(pages)
    return PagedKVCache(k=cache.k.at[:, :, idx].set(nan), v=cache.v.at[:, :, idx].set(nan),
                        block_pages=cache.block_pages, numbers=cache.numbers)


# two sequences: 21 cached + a chunk of 4 new, and 37 cached + 2 new (padded to 4); their
# page tables padded past their ends with a poisoned page (39)
TABLE = np.array([[7, 3, 11, 0, 30, 8, 26, 39, 39, 39, 39, 39],
                  [2, 9, 5, 14, 1, 33, 20, 12, 31, 17, 39, 39]], np.int32)
LENGTHS, NUM_NEW = np.array([21, 37], np.int32), np.array([4, 2], np.int32)


def _call(q, cache, layer, table, lengths, num_new, window, depth=None, ancestors=None):
    batch = BatchInfo(jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(num_new),
                      depth=None if depth is None else jnp.asarray(depth),
                      ancestors=None if ancestors is None else jnp.asarray(ancestors))
    fn = jax.jit(lambda q, c, b: attention.paged_attention(q, c, layer, b, window))
    return np.asarray(fn(jnp.asarray(q), cache, batch))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("h", "n", "kv"), [(64, 6, 2), (20, 4, 4), (8, 3, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_the_kernels_bits_are_the_numpy_references(dtype, h, n, kv, window):
    """Head dims a multiple of 16 and not (lanes zero-padded), grouped heads, windows,
    two layers, float32 and bfloat16 pages; unwritten slots and padded pages poisoned."""
    k, v, cache = _pools(h, kv, dtype)
    cache = _poisoned(cache, [39])
    q = np.random.default_rng(1).standard_normal((2, 4, n, h)).astype(np.float32) / 2
    got = _call(q, cache, 1, TABLE, LENGTHS, NUM_NEW, window)
    want = attention.reference(q, k, v, 1, TABLE, LENGTHS, NUM_NEW, window)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all() and (got[1, 2:] == 0).all()  # padded queries: 0


def test_a_tree_verifys_bits_are_the_numpy_references():
    """Each node reads its ancestors from the slots they were written at (`ancestors`),
    at its own depth's position, beside a row of a chain padded to the tree's width."""
    k, v, cache = _pools(16, 2)
    depth, ancestors = tree_arrays(TREE, len(TREE))
    chain = tree_arrays([-1, 0, 1], len(TREE))
    depth, ancestors = np.stack([depth, chain[0]]), np.stack([ancestors, chain[1]])
    lengths, num_new = np.array([6, 10], np.int32), np.array([len(TREE), 3], np.int32)
    q = np.random.default_rng(2).standard_normal((2, len(TREE), 4, 16)).astype(np.float32)
    for window in (None, 4):
        got = _call(q, cache, 0, TABLE, lengths, num_new, window, depth, ancestors)
        want = attention.reference(q, k, v, 0, TABLE, lengths, num_new, window, None, depth,
                                   ancestors)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("window", [None, 5])
def test_longer_chunks_and_trees_keep_the_numpy_references_bits(window):
    """Chunks of 13 and 11 new queries (the second padded to 13) and a tree of 11 nodes
    on both rows, with and without a window shorter than the chunk."""
    k, v, cache = _pools(64, 3)
    rng = np.random.default_rng(4)
    lengths, num_new = np.array([10, 20], np.int32), np.array([13, 11], np.int32)
    q = rng.standard_normal((2, 13, 9, 64)).astype(np.float32)
    got = _call(q, cache, 1, TABLE, lengths, num_new, window)
    np.testing.assert_array_equal(
        got, attention.reference(q, k, v, 1, TABLE, lengths, num_new, window))
    tree = [-1, 0, 0, 1, 1, 2, 4, 4, 5, 6, 8]
    depth, ancestors = (np.stack([a, a]) for a in tree_arrays(tree, len(tree)))
    lengths, num_new = np.array([6, 9], np.int32), np.array([len(tree), 9], np.int32)
    q = rng.standard_normal((2, len(tree), 9, 64)).astype(np.float32)
    got = _call(q, cache, 0, TABLE, lengths, num_new, window, depth, ancestors)
    np.testing.assert_array_equal(got, attention.reference(
        q, k, v, 0, TABLE, lengths, num_new, window, None, depth, ancestors))


def test_a_querys_bits_are_its_own_alone_in_a_chunk_or_beside_other_rows():
    """Each query of sequence 0's chunk computed alone (a decode step at its position, one
    row, its page table cut to its pages) has the bits it gets in the chunk beside row 1."""
    _, _, cache = _pools(64, 3)
    q = np.random.default_rng(3).standard_normal((2, 4, 9, 64)).astype(np.float32)
    together = _call(q, cache, 0, TABLE, LENGTHS, NUM_NEW, None)
    for t in range(4):
        pos = LENGTHS[0] + t
        alone = _call(q[:1, t:t + 1], cache, 0, TABLE[:1, :pos // PS + 1],
                      np.array([pos]), np.array([1]), None)
        np.testing.assert_array_equal(alone[0, 0], together[0, t])


def _full(q, k, v, layer, table, length, num, window, h):
    """Sequence attention in float64 from the pages: [num, N, H]."""
    slots = np.arange(length + num)
    keys = k[layer][:, table[slots // PS], slots % PS].astype(np.float64)  # [K, S, H]
    values = v[layer][:, table[slots // PS], slots % PS].astype(np.float64)
    g = q.shape[1] // k.shape[1]
    out = np.zeros((num, q.shape[1], h))
    for t in range(num):
        pos = length + t
        lo = max(0, pos - window + 1) if window else 0
        for head in range(q.shape[1]):
            s = keys[head // g, lo:pos + 1] @ q[t, head].astype(np.float64) / np.sqrt(h)
            e = np.exp(s - s.max())
            out[t, head] = e @ values[head // g, lo:pos + 1] / e.sum()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_values_within_ten_times_the_measured_error_of_float64_and_xlas_attention(window):
    k, v, cache = _pools(64, 2)
    q = np.random.default_rng(4).standard_normal((2, 4, 6, 64)).astype(np.float32) * 2
    got = _call(q, cache, 1, TABLE, LENGTHS, NUM_NEW, window)
    for b in range(2):
        want = _full(q[b], k, v, 1, TABLE[b], LENGTHS[b], NUM_NEW[b], window, 64)
        # measured 6.8e-7 (values up to 3.5)
        assert np.abs(got[b, :NUM_NEW[b]] - want).max() < 7e-6
    batch = BatchInfo(jnp.asarray(TABLE), jnp.asarray(LENGTHS), jnp.asarray(NUM_NEW))
    xla = np.asarray(paged_attention_reference(jnp.asarray(q), cache, 1, batch, window, 32))
    # measured 8.9e-7: the same keys, another order of the sums
    assert np.abs(got[0] - xla[0]).max() < 9e-6 and np.abs(got[1, :2] - xla[1, :2]).max() < 9e-6


def test_a_tree_verify_sees_what_xlas_attention_sees():
    _, _, cache = _pools(16, 2)
    depth, ancestors = tree_arrays(TREE, len(TREE))
    batch = BatchInfo(jnp.asarray(TABLE[:1]), jnp.asarray([6]), jnp.asarray([len(TREE)]),
                      depth=jnp.asarray(depth[None]), ancestors=jnp.asarray(ancestors[None]))
    q = np.random.default_rng(5).standard_normal((1, len(TREE), 4, 16)).astype(np.float32)
    got = _call(q, cache, 0, TABLE[:1], [6], [len(TREE)], 3, depth[None], ancestors[None])
    xla = np.asarray(paged_attention_reference(jnp.asarray(q), cache, 0, batch, 3, 32))
    # measured 4.8e-7; with a node reading slot lengths + j for its ancestor at depth j
    # (siblings' keys instead of its ancestors') 3.3
    assert np.abs(got - xla).max() < 5e-6


def test_pages_the_kernel_cannot_read_get_a_clear_error():
    assert attention.unsupported("float32") is None and attention.unsupported("bfloat16") is None
    assert attention.unsupported("int8") == "int8 pages"
    assert attention.unsupported("float32", 50.0) == "soft-capped scores"
    scaled = PagedKVCache(k=jnp.zeros((1, 1, 2, PS, 8), jnp.int8),
                          v=jnp.zeros((1, 1, 2, PS, 8), jnp.int8), block_pages=1,
                          k_scale=jnp.ones((1, 1, 2, PS)), v_scale=jnp.ones((1, 1, 2, PS)))
    batch = BatchInfo(jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32),
                      jnp.ones(1, jnp.int32))
    with pytest.raises(ValueError, match="does not read scaled"):
        attention.paged_attention(jnp.zeros((1, 1, 2, 8)), scaled, 0, batch, None)
