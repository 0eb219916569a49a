"""Attention over the new tokens themselves, over the paged cache, and over a dense cache.

Legend: B batch, T new tokens (queries), S keys, K kv heads, G query heads per kv head,
H head dim, N = K * G query heads.

The paged path reduces over the cache one attention block (a fixed number of whole pages)
at a time, in a fixed order of absolute positions, with an online softmax. A fully masked
block contributes exactly nothing, so a query's result is bitwise independent of how many
pages the page table is padded to and of where its prefill chunk started; blocks no query
can see are therefore skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache import kivi
from kvjax.cache.dense import DenseKVCache
from kvjax.cache.paged import BatchInfo, PagedKVCache, dequantize
from kvjax.model.tiled import tree_sum

_M_INIT = -1e30  # finite running-max start: exp(-inf - _M_INIT) == 0, never NaN


def _mask(q_pos: jax.Array, k_pos: jax.Array, causal: bool, window: int | None) -> jax.Array:
    """[..., T, S] True where query at q_pos[..., T] may see key at k_pos[..., S]."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    mask = diff >= 0 if causal else jnp.ones_like(diff, dtype=bool)
    if window is not None:
        mask = mask & (diff < window) if causal else mask & (jnp.abs(diff) < window)
    return mask


def _grouped(q: jax.Array, num_kv_heads: int, scale: float | None) -> jax.Array:
    """[B, T, N, H] -> [B, T, K, G, H], scaled by `scale` (None: 1/sqrt(H))."""
    b, t, n, h = q.shape
    q = q * jnp.asarray(h**-0.5 if scale is None else scale, q.dtype)
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def _capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Scores soft-capped to (-cap, cap) by cap * tanh(scores / cap) (Gemma 2); None: as is."""
    if softcap is None:
        return scores
    return jnp.tanh(scores / softcap) * softcap


def full_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                   causal: bool, window: int | None, scale: float | None = None,
                   softcap: float | None = None) -> jax.Array:
    """Attention of a whole sequence over itself (the no-cache reference). `scale`
    multiplies the queries (None: 1/sqrt(H)); `softcap` caps the scores (`_capped`).

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H]; positions: int32[B, T].
    Returns: [B, T, N, H]
    """
    qg = _grouped(q, k.shape[2], scale)
    scores = _capped(jnp.einsum("BTKGH,BSKH->BKGTS", qg, k), softcap)
    mask = _mask(positions, positions, causal, window)[:, None, None]  # [B, 1, 1, T, S]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(q.shape)


def paged_attention_reference(q: jax.Array, cache: PagedKVCache, layer: int, batch: BatchInfo,
                              window: int | None, row_tile: int | None = None,
                              scale: float | None = None,
                              softcap: float | None = None,
                              fresh: kivi.Fresh | None = None) -> jax.Array:
    """Causal attention of new queries over the paged cache (which already holds them).

    A KV head's query rows (T queries x G heads of its group) are the rows of its two
    products with a block's keys. `row_tile` R cuts them into tiles of 2..R rows that
    form a batch axis of the products (the keys broadcast to it), so every product has a
    row count in 2..R whatever T is: a query's bits then do not depend on how many queries
    share the call, the one property of a row that changes them on XLA CPU (on AVX-512 a
    batched product's row bits held across batch counts and row counts 2..32 at every
    attention shape measured; T * G rows in one product changed them from 64 rows at
    H = 16, S = 32; on AVX2 at H = 8 from 8 rows: `kvjax.model.tiled.choose_blocks`
    probes every count of a tile). 0: one product of all T * G rows, at least two (for
    shapes where the backend keeps the rows invariant at every count,
    `kvjax.model.tiled.choose_blocks`). None: one
    product of all T * G rows (fastest; a lone row is not padded). The softmax normaliser
    is a fixed-order sum (`tree_sum`). `scale` and `softcap` as in `full_attention`.
    `fresh` (int4_kivi pages, `kvjax.cache.kivi`): each query sees its own page's keys and
    values as these float numbers, and earlier pages dequantized; its scores and products
    with its own page's keys are the same products, so a query's bits stay its own.

    A tree verify (`batch.ancestors`, see `BatchInfo`): each tile holds one node's rows,
    tiled as a lone query's are, and sees at slot `lengths + j` its ancestor at depth j
    (read from where that node was written): the keys, values and blocks plain decoding
    would give the node at its position, so under invariant numerics its bits are plain
    decoding's. Without a `row_tile` (fast numerics, no bitwise promise) a tree is tiled as
    a chain is, all nodes' rows in one product, and a mask does the rest: node t sees slot
    `lengths + i` when node i is its ancestor or itself, at i's position (`_tree_mask`).

    Args:
      q: [B, T, N, H], queries at positions `batch.lengths + t` (tree: `+ depth`).
    Returns: [B, T, N, H]
    """
    b, t, n, h = q.shape
    kv = cache.k.shape[1]
    g = n // kv
    fast_tree = batch.ancestors is not None and row_tile is None
    tree = batch.ancestors is not None and not fast_tree  # one node per tile
    if batch.ancestors is not None and fresh is not None:
        raise NotImplementedError("tree verify over int4_kivi pages")
    rows = g if tree else t * g  # the rows tiled together: one node's, or every query's
    tile = rows if row_tile is None else max(2, min(row_tile or rows, rows))
    per = -(-rows // tile)  # tiles of `tile` query rows, the last one padded
    nt = t * per if tree else per
    block_pages, ps = cache.block_pages, cache.page_size
    block_len = block_pages * ps
    num_blocks = batch.page_table.shape[1] // block_pages
    qg = _grouped(q, kv, scale)  # [B, T, K, G, H]
    at = jnp.arange(per * tile, dtype=jnp.int32)
    if tree:
        qg = jnp.pad(qg, ((0, 0),) * 3 + ((0, per * tile - g), (0, 0)))
        qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kv, nt, tile, h)
        q_pos = (batch.lengths[:, None] + batch.depth)[:, :, None]  # [B, T, 1]
        q_pos = jnp.where(at < g, q_pos, -1).reshape(b, nt, tile)  # padded rows see nothing
    else:
        qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kv, rows, h)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, nt * tile - rows), (0, 0)))
        qg = qg.reshape(b, kv, nt, tile, h)  # [B, K, nt, R, H]
        q_pos = batch.lengths[:, None] + at[None, :] // g
        if fast_tree:
            q_pos = batch.lengths[:, None] + jnp.take_along_axis(
                batch.depth, jnp.minimum(at // g, t - 1)[None, :], axis=1)
        q_pos = jnp.where(at < rows, q_pos, -1).reshape(b, nt, tile)  # [B, nt, R]
    end = batch.lengths + batch.num_new  # [B] keys at or past `end` are unwritten
    blocks = batch.page_table.reshape(b, num_blocks, block_pages).transpose(1, 0, 2)
    trees = (batch.lengths, batch.ancestors, batch.page_table) if tree else None
    if fast_tree:  # seen[b, t, i]: node i is node t's ancestor or node t itself
        seen = ((batch.ancestors[..., None] == jnp.arange(t))
                & (jnp.arange(t)[:, None] <= batch.depth[..., None, None])).any(axis=2)
        trees = (batch.lengths, batch.depth, seen)

    def gather(pool: jax.Array, scales: jax.Array | None, pages: jax.Array,
               keys: bool = False) -> jax.Array:
        """[b, K, nt, S, H] keys or values of `pages` [b, block_pages] in this layer (int8
        pages: times their `scales`).

        One gather from the whole pool: slicing the layer out first (`pool[layer]`) would
        materialise a copy of the layer's pages at every step, a cost that grows with the
        pool's size instead of the sequence's length (docs/benchmarks.md, "Measurements
        behind design choices").
        """
        rows_ = pages.shape[0]
        picked = cache.read(pool[layer, :, pages])  # [b, block_pages, K, page_size, H]
        if fresh is not None:  # int4: a scale per channel (keys) or per token (values)
            unpack = kivi.dequantize_keys if keys else kivi.dequantize_values
            picked = unpack(picked, scales[layer, :, pages], q.dtype)
        elif scales is not None:  # [b, block_pages, K, page_size]
            picked = dequantize(picked, scales[layer, :, pages], q.dtype)
        picked = picked.transpose(0, 2, 1, 3, 4).reshape(rows_, kv, 1, block_len, h)
        return jnp.broadcast_to(picked.astype(q.dtype), (rows_, kv, nt, block_len, h))

    def tree_gather(pool, scales, k_pos, tree_):
        """[b, K, nt, S, H] keys or values at `k_pos` [S] as each tile's node sees them:
        slot lengths + j (j >= 0) holds its ancestor at depth j, read from the slot that
        ancestor was written at; earlier slots as they are."""
        lengths_, anc, table = tree_
        j = k_pos[None, :] - lengths_[:, None]  # [b, S]
        node = jnp.arange(nt) // per  # [nt] each tile's node
        depth_j = jnp.broadcast_to(jnp.clip(j, 0, t - 1)[:, None, :], (j.shape[0], nt,
                                                                        block_len))
        src = jnp.take_along_axis(anc[:, node], depth_j, axis=2)  # [b, nt, S]
        slot = jnp.where(j[:, None, :] >= 0, lengths_[:, None, None] + src, k_pos)
        page = jnp.take_along_axis(table, jnp.clip(slot // ps, 0, table.shape[1] - 1)
                                   .reshape(slot.shape[0], -1), axis=1).reshape(slot.shape)
        picked = cache.read(pool[layer, :, page, slot % ps])  # [b, nt, S, K, H]
        if scales is not None:
            picked = dequantize(picked, scales[layer, :, page, slot % ps], q.dtype)
        return picked.transpose(0, 3, 1, 2, 4).astype(q.dtype)

    def own_page(fresh_, k_pos, q_pos_):
        """The block's keys and values as `fresh_` holds them [b, K, nt, S, H], and where a
        query's own page they are [b, 1, nt, R, S]."""
        at = k_pos[None, :] - fresh_.base[:, None]  # [b, S] into the window
        at = jnp.clip(at, 0, fresh_.k.shape[1] - 1)[:, :, None, None]

        def pick(w):
            x = jnp.take_along_axis(w, at, axis=1).transpose(0, 2, 1, 3)  # [b, K, S, H]
            return jnp.broadcast_to(x[:, :, None].astype(q.dtype), (x.shape[0], kv, nt,
                                                                    block_len, h))

        own = (k_pos[None, None, None, :] // ps == q_pos_[..., None] // ps)[:, None]
        return pick(fresh_.k), pick(fresh_.v), own

    def update(carry, index, pages, qg_, q_pos_, end_, fresh_=None, tree_=None):
        """One block of keys `index` for the rows of `pages` [b, block_pages] (all rows, or
        one): their queries qg_ [b, K, nt, R, H] at q_pos_ [b, nt, R], written up to end_;
        a tree verify's `tree_` (lengths, ancestors, page table) of those rows."""
        m, l, acc = carry  # [b, K, nt, R] and acc [b, K, nt, R, H]
        k_pos = index * block_len + jnp.arange(block_len, dtype=jnp.int32)  # [S]
        if tree_ is None or fast_tree:
            k = gather(cache.k, cache.k_scale, pages, keys=True)
            v = gather(cache.v, cache.v_scale, pages)
        else:  # blocks wholly before every row's tree hold the same keys for every node
            k, v = jax.lax.cond(
                (index + 1) * block_len <= jnp.min(tree_[0]),
                lambda: (gather(cache.k, cache.k_scale, pages, keys=True),
                         gather(cache.v, cache.v_scale, pages)),
                lambda: (tree_gather(cache.k, cache.k_scale, k_pos, tree_),
                         tree_gather(cache.v, cache.v_scale, k_pos, tree_)))
        written = k_pos[None, :] < end_[:, None]  # [b, S]
        v = jnp.where(written[:, None, None, :, None], v, 0)  # a poisoned page never leaks in
        if fast_tree:
            mask = _tree_mask(q_pos_, k_pos, tree_, g, window)
        else:
            mask = _mask(q_pos_, k_pos[None, None, :], True, window)  # [b, nt, R, S]
        mask = (mask & written[:, None, None, :])[:, None]  # [b, 1, nt, R, S]
        s = _capped(jnp.einsum("BKnRH,BKnSH->BKnRS", qg_, k), softcap)
        if fresh_ is not None:
            k_own, v_own, own = own_page(fresh_, k_pos, q_pos_)
            v_own = jnp.where(written[:, None, None, :, None], v_own, 0)
            # a page not full yet is its pool page's old contents (NaN when poisoned): only
            # its own queries see it, from `fresh_`, and 0 x NaN would still be NaN
            full = (k_pos[None, :] // ps + 1) * ps <= end_[:, None]  # [b, S]
            v = jnp.where(full[:, None, None, :, None], v, 0)
            s = jnp.where(own, _capped(jnp.einsum("BKnRH,BKnSH->BKnRS", qg_, k_own), softcap),
                          s)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * correction + tree_sum(p)
        if fresh_ is None:
            pv = jnp.einsum("BKnRS,BKnSH->BKnRH", p, v)
        else:  # the own page's share from its float values, the rest from the pages'
            pv = (jnp.einsum("BKnRS,BKnSH->BKnRH", jnp.where(own, 0, p), v)
                  + jnp.einsum("BKnRS,BKnSH->BKnRH", jnp.where(own, p, 0), v_own))
        acc = acc * correction[..., None] + pv
        return m_new, l, acc

    def step(index, carry):  # block `index` of every row
        pages = jax.lax.dynamic_index_in_dim(blocks, index, keepdims=False)  # [B, block_pages]
        return update(carry, index, pages, qg, q_pos, end, fresh, trees)

    shape = (b, kv, nt, tile)
    init = (jnp.full(shape, _M_INIT, q.dtype), jnp.zeros(shape, q.dtype),
            jnp.zeros((*shape, h), q.dtype))
    # Only blocks that some query can see are visited; the skipped ones are fully masked and
    # would contribute exactly nothing, so skipping them changes no bit of the result.
    row_stop = jnp.minimum((end + block_len - 1) // block_len, num_blocks)  # [B]
    stop = jnp.max(row_stop)
    row_start = jnp.zeros(b, jnp.int32)  # [B] each row's first visible block
    if window is not None:
        row_start = jnp.maximum(batch.lengths - window + 1, 0) // block_len
    start = jnp.min(row_start)
    # Row-invariant attention (row_tile set) visits every row's blocks together only up to
    # the shortest written row's last block, then each row's further blocks on their own
    # (a row alone is a batch of one: the start-up probe checks a sequence of three against
    # itself alone, and the invariance tests every row of mixed-length batches),
    # so a long row does not make the others visit its blocks. Fast numerics visit every
    # block of every row together (their products may change bits with the batch).
    mid = stop
    if row_tile is not None:
        mid = jnp.clip(jnp.min(jnp.where(end > 0, row_stop, num_blocks)), start, stop)
    carry = jax.lax.fori_loop(start, mid, step, init)
    if row_tile is not None:  # each row's blocks past the shared ones, the row alone
        first = jnp.maximum(mid, row_start)  # [B] each row's first block past the shared ones
        extra = jnp.maximum(row_stop - first, 0)  # [B] each row's blocks from `first`
        last = jnp.cumsum(extra)  # [B] one past each row's last task

        def ragged(task, carry):  # one row's next block past the shared ones
            r = jnp.searchsorted(last, task, side="right")
            index = first[r] + task - (last[r] - extra[r])
            one = lambda a: jax.lax.dynamic_slice_in_dim(a, r, 1)  # noqa: E731
            part = update(tuple(map(one, carry)), index, blocks[index, r][None], one(qg),
                          one(q_pos), one(end),
                          None if fresh is None else jax.tree.map(one, fresh),
                          None if trees is None else tuple(map(one, trees)))
            return tuple(jax.lax.dynamic_update_slice_in_dim(c, x, r, 0)
                         for c, x in zip(carry, part, strict=True))

        carry = jax.lax.fori_loop(0, last[-1], ragged, carry)
    _, l, acc = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1)[..., None], 0)
    if tree:  # [b, K, T * per, R, H] -> each node's g rows
        out = out.reshape(b, kv, t, per * tile, h)[:, :, :, :g]
    else:
        out = out.reshape(b, kv, nt * tile, h)[:, :, :rows].reshape(b, kv, t, g, h)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, n, h)


def _tree_mask(q_pos: jax.Array, k_pos: jax.Array, tree: tuple, g: int,
               window: int | None) -> jax.Array:
    """[b, 1, R, S] of a tree verify tiled as a chain (one tile of T * g rows, row r node
    r // g, at q_pos [b, 1, R]): a key before the tree is seen as causal attention sees it;
    slot `lengths + i` holds node i, seen by node i's descendants and itself, at node i's
    position (`lengths + depth[i]`: the window counts from there)."""
    lengths, depth, seen = tree  # [b], [b, T], [b, T, T]
    t = depth.shape[1]
    i = k_pos[None, :] - lengths[:, None]  # [b, S] the tree node a slot holds, if >= 0
    node_i = jnp.clip(i, 0, t - 1)
    k_eff = jnp.where(i >= 0, lengths[:, None] + jnp.take_along_axis(depth, node_i, axis=1),
                      k_pos[None, :])  # [b, S]
    rows = q_pos.shape[-1]
    node_r = jnp.minimum(jnp.arange(rows) // g, t - 1)  # [R]
    visible = (i[:, None, :] < 0) | jnp.take_along_axis(
        seen[:, node_r], jnp.broadcast_to(node_i[:, None, :], (i.shape[0], rows, i.shape[1])),
        axis=2)  # [b, R, S]
    return _mask(q_pos, k_eff[:, None, :], True, window) & visible[:, None]


def dense_attention(q: jax.Array, cache: DenseKVCache, layer: int, batch: BatchInfo,
                    window: int | None, scale: float | None = None,
                    softcap: float | None = None) -> jax.Array:
    """Baseline: attention over a contiguous [B, max_len] cache in one softmax."""
    if batch.ancestors is not None:
        raise NotImplementedError("tree verify over the dense baseline cache")
    t = q.shape[1]
    qg = _grouped(q, cache.k.shape[3], scale)
    k = cache.read(cache.k[layer]).astype(q.dtype)  # [B, S, K, H]
    v = cache.read(cache.v[layer]).astype(q.dtype)
    q_pos = batch.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    mask = _mask(q_pos, k_pos, True, window)[:, None, None]
    s = _capped(jnp.einsum("BTKGH,BSKH->BKGTS", qg, k), softcap)
    probs = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(q.shape)
