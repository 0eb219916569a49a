"""EAGLE-style trees drafted on device, inside `tree_loop`: the host `EagleTreeDrafter`'s
trees, node for node, without a host round trip per tree level. Device code: pure JAX.

Row b with L target tokens cached has the history h_0 .. h_L (h_L the newest token, the
tree's root) and the target's features F_0 .. F_{L-1}. The head's cache holds the pairs
[F_j, e(h_{j+1})] for j < L - 1 (`HeadDraft.cached`); the pairs a round accepted are
`pending`. `grow` runs them and the root pair [F_{L-1}, e(h_L)] as one causal extend (width
`W` + 1: the catch-up and the first level's pass in one, the root's prediction the last
real row's), then grows the tree (EAGLE-2's rule as `tree_model.grow_tree` applies it, a
full tree extend of the head per further level); after the verify `absorb` makes the
accepted path's pairs the next round's pending ones, with the target's own features.

Legend: B rows, N tree nodes (max_nodes), K top_k, D model width, W the pending width
(depth + 1), R the draft vocabulary.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, PagedKVCache, model_positions
from kvjax.config import ModelConfig
from kvjax.model.layout import unstored
from kvjax.model.plan import NumericsPlan
from kvjax.speculative.eagle import EagleHead, draft_log_probs, embed, head_config


@flax.struct.dataclass
class HeadDraft:
    """The head's side of a device tree loop (module docstring)."""

    head: dict  # the head's parameters, stored as `plan` takes them (`layout.store`)
    embedding: jax.Array  # [V, D] the target's input embedding (canonical)
    head_w: jax.Array  # [R, D] the target's output head rows of the draft vocabulary
    vocab: jax.Array  # int32[R] their token ids
    cache: PagedKVCache  # the head's paged cache (one layer)
    page_table: jax.Array  # int32[B, P] the head cache's pages of each row
    cached: jax.Array  # int32[B] pairs in the head cache
    feature: jax.Array  # float32[B, D] F_{L-1}: the root pair's feature
    pending_features: jax.Array  # float32[B, W, D]
    pending_tokens: jax.Array  # int32[B, W]
    pending: jax.Array  # int32[B] pending pairs
    plan: NumericsPlan = flax.struct.field(pytree_node=False)  # the head's arithmetic


FIXED = ("head", "embedding", "head_w", "vocab", "page_table")  # what a call never changes


def loop_state(d: HeadDraft) -> HeadDraft:
    """`d` without its fixed arrays: what a loop carries and returns (carrying the
    embedding would copy it out of every call)."""
    return d.replace(**dict.fromkeys(FIXED))


def with_fixed(state: HeadDraft, d: HeadDraft) -> HeadDraft:
    """`state` (a `loop_state`) with `d`'s fixed arrays."""
    return state.replace(**{name: getattr(d, name) for name in FIXED})


def _run(d: HeadDraft, config: ModelConfig, features, tokens, batch: BatchInfo
         ) -> tuple[jax.Array, HeadDraft]:
    """One extend of the head over features [B, T, D] and tokens int32[B, T]: (the
    predictions [B, T, D], the draft with its cache)."""
    x = embed({"embed": {"embedding": d.embedding}}, config, tokens)
    pred, cache = EagleHead(head_config(config), d.plan).apply(
        {"params": unstored(d.head, d.plan)}, features, x,
        model_positions(batch, tokens.shape[1]), d.cache, batch)
    return pred, d.replace(cache=cache)


def _best(d: HeadDraft, config: ModelConfig, pred: jax.Array, k: int
          ) -> tuple[jax.Array, jax.Array]:
    """(the `k` best log-probabilities [..., k] of the next token over the draft vocabulary
    after predictions pred [..., D], their columns), as `head_extend` gives them."""
    return jax.lax.top_k(draft_log_probs(config, pred, d.head_w, d.plan), k)


def catch_up(d: HeadDraft, config: ModelConfig, last: jax.Array, active: jax.Array
             ) -> tuple[jax.Array, HeadDraft]:
    """The pending pairs of the `active` rows into the head cache, and the root pair
    [feature, e(last)] after them in the same extend (its slot is the tree's root's,
    scratch until a level's pass writes the tree there): (the root's prediction [B, D], the
    draft). An inactive row writes nothing (an engine's empty slot has no pages) and keeps
    its pending pairs."""
    rows = jnp.arange(last.shape[0])
    features = jnp.concatenate([d.pending_features, jnp.zeros_like(d.feature)[:, None]], 1)
    features = features.at[rows, d.pending].set(d.feature.astype(features.dtype))
    tokens = jnp.concatenate([d.pending_tokens, jnp.zeros_like(last)[:, None]], 1)
    tokens = tokens.at[rows, d.pending].set(last)  # [B, W + 1]
    pred, d = _run(d, config, features, tokens, BatchInfo(
        d.page_table, d.cached, jnp.where(active, d.pending + 1, 0)))
    caught = jnp.where(active, d.pending, 0)
    return pred[rows, d.pending], d.replace(cached=d.cached + caught,
                                            pending=d.pending - caught)


def grow(d: HeadDraft, last: jax.Array, reach: jax.Array, max_nodes: int, depth: int,
         top_k: int, config: ModelConfig, layout, active: jax.Array | None = None,
         rerank: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, HeadDraft]:
    """(parents int32[B, N] (-1: the root and padding), tokens int32[B, N], nodes int32[B],
    the draft) of each row's tree from the root `last` int32[B], the pending pairs caught up
    first (`catch_up`): at most min(`depth`, `reach[b]`) levels, each adding the `top_k`
    best offers of the last level's nodes by cumulative log-probability (float32, ties to
    the earlier offer), within `max_nodes`; with `rerank` (EAGLE-2's final step) every level
    adds its `top_k` (1 + top_k x depth candidates, `candidates`) and the tree is the
    max_nodes - 1 best of them by that score (`rerank_nodes`). `layout`:
    `tree_loop.tree_layout`. Rows not `active` (bool[B]; None: all are) write nothing to the
    head's cache."""
    b, k = last.shape[0], top_k
    rows = jnp.arange(b)
    active = jnp.ones((b,), bool) if active is None else active
    out_nodes, max_nodes = max_nodes, candidates(max_nodes, depth, k, rerank)  # grown first
    root, d = catch_up(d, config, last, active)  # [B, D]
    parents = jnp.full((b, max_nodes), -1, jnp.int32)
    tokens = jnp.zeros((b, max_nodes), jnp.int32).at[:, 0].set(last)
    score = jnp.zeros((b, max_nodes), jnp.float32)
    inputs = jnp.zeros((b, max_nodes, d.feature.shape[-1]), d.feature.dtype)
    inputs = inputs.at[:, 0].set(d.feature)
    nodes = jnp.ones((b,), jnp.int32)
    frontier = jnp.full((b, k), -1, jnp.int32).at[:, 0].set(0)
    levels = jnp.minimum(depth, reach)
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]

    def add(i, front, best, cols, carry):
        """Level i's offers from the predictions `front` [B, K, D] of its frontier nodes and
        their `k` best next tokens (log-probabilities `best` [B, K, K], columns `cols`)."""
        parents, tokens, score, inputs, nodes, frontier, d = carry
        going = (i < levels) & (nodes < max_nodes) & jnp.any(frontier >= 0, axis=1)
        at = jnp.maximum(frontier, 0)  # [B, K]
        offer = score[rows[:, None], at][:, :, None] + best  # [B, K, K]
        offer = jnp.where(frontier[:, :, None] >= 0, offer, -jnp.inf).reshape(b, k * k)
        value, pick = jax.lax.top_k(offer, k)  # ties: the lower index, the earlier offer
        node = jnp.take_along_axis(at, pick // k, 1)  # [B, K]
        token = d.vocab[jnp.take_along_axis(cols.reshape(b, k * k), pick, 1)]
        take = jnp.where(going, jnp.minimum(k, max_nodes - nodes), 0)
        new = jnp.where(slot < take[:, None], nodes[:, None] + slot, max_nodes)  # [B, K]
        parents = parents.at[rows[:, None], new].set(node, mode="drop")
        tokens = tokens.at[rows[:, None], new].set(token, mode="drop")
        score = score.at[rows[:, None], new].set(value, mode="drop")
        inputs = inputs.at[rows[:, None], new].set(
            jnp.take_along_axis(front, (pick // k)[:, :, None], 1), mode="drop")
        frontier = jnp.where(going[:, None], jnp.where(slot < take[:, None], new, -1),
                             frontier)
        return parents, tokens, score, inputs, nodes + take, frontier, d

    def level(i, carry):
        parents, tokens, score, inputs, nodes, frontier, d = carry
        tree_depth, ancestors = layout(parents, nodes)
        batch = BatchInfo(d.page_table, d.cached, jnp.where(active, nodes, 0),
                          depth=tree_depth, ancestors=ancestors)
        pred, d = _run(d, config, inputs, tokens, batch)
        front = pred[rows[:, None], jnp.maximum(frontier, 0)]  # [B, K, D]
        # the draft vocabulary's head on the last level's nodes only: the rest is not read
        return add(i, front, *_best(d, config, front, k),
                   (parents, tokens, score, inputs, nodes, frontier, d))

    # every level adds min(k, room) nodes: the tree is full after this many, whatever the
    # draft says, and a level past it would be a head pass for nothing
    full = min(depth, -(-(max_nodes - 1) // k))
    carry = (parents, tokens, score, inputs, nodes, frontier, d)
    if full > 0:  # the first level's offers: the root's prediction, from the catch-up (its
        # frontier is the root alone: the other slots' offers are masked, their values unread)
        best, cols = _best(d, config, root[:, None], k)  # [B, 1, K]
        carry = add(0, jnp.broadcast_to(root[:, None], (b, k, root.shape[-1])),
                    jnp.broadcast_to(best, (b, k, k)), jnp.broadcast_to(cols, (b, k, k)), carry)
    parents, tokens, score, _, nodes, _, d = jax.lax.fori_loop(1, max(full, 1), level, carry)
    if rerank:
        parents, tokens, nodes = rerank_nodes(parents, tokens, score, nodes, out_nodes)
    return parents, tokens, nodes, d


def candidates(max_nodes: int, depth: int, top_k: int, rerank: bool) -> int:
    """The nodes a tree is grown to before it is cut to `max_nodes`: with `rerank`, every
    level's `top_k` offers (1 + top_k x depth, at least max_nodes); else max_nodes."""
    return max(max_nodes, 1 + top_k * depth) if rerank else max_nodes


def rerank_nodes(parents: jax.Array, tokens: jax.Array, score: jax.Array, nodes: jax.Array,
                 max_nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """EAGLE-2's rerank: (parents int32[B, max_nodes], tokens, nodes) of each row's tree
    ([B, C] candidates, `nodes[b]` of them real) cut to the root and its max_nodes - 1 best
    nodes by cumulative log-probability `score` (ties: the lower index), in their order. A
    node's score is at most its parent's (log-probabilities are <= 0) and a parent comes
    first, so a kept node's ancestors are kept: the cut is a tree."""
    b, c = parents.shape
    rows = jnp.arange(b)[:, None]
    real = (jnp.arange(c)[None, :] > 0) & (jnp.arange(c)[None, :] < nodes[:, None])
    _, pick = jax.lax.top_k(jnp.where(real, score, -jnp.inf), max_nodes - 1)  # [B, N - 1]
    ok = jnp.take_along_axis(real, pick, 1)
    keep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                            jnp.sort(jnp.where(ok, pick, c), axis=1).astype(jnp.int32)], 1)
    # new index of each candidate (c: a padding column, for the dropped slots)
    index = jnp.full((b, c + 1), -1, jnp.int32).at[rows, keep].set(
        jnp.arange(max_nodes, dtype=jnp.int32)[None, :])
    padded = jnp.concatenate([parents, jnp.full((b, 1), -1, jnp.int32)], 1)
    old = jnp.take_along_axis(padded, keep, 1)  # [B, N]: each kept node's parent, old index
    new_parents = jnp.where(old >= 0, jnp.take_along_axis(index, jnp.maximum(old, 0), 1), -1)
    new_tokens = jnp.take_along_axis(jnp.concatenate([tokens, jnp.zeros((b, 1), tokens.dtype)],
                                                     1), keep, 1)
    return new_parents, new_tokens, (1 + ok.sum(1)).astype(jnp.int32)


def absorb(d: HeadDraft, path: jax.Array, kept: jax.Array, fed: jax.Array,
           features: jax.Array) -> HeadDraft:
    """After a verify: the pairs of the `kept[b]` tokens cached (the root and the emitted
    drafts, path int32[B, W] into the tree's nodes `fed` int32[B, N]) become pending, each
    with the target's feature before it (`features` [B, N, D]: the verify's), and the
    feature of the last kept node the next root pair's. A row that kept nothing (not
    active) keeps its state."""
    rows = jnp.arange(path.shape[0])
    node_feats = features[rows[:, None], path]  # [B, W, D]
    before = jnp.concatenate([d.feature[:, None], node_feats[:, :-1]], axis=1)
    last = jnp.take_along_axis(path, jnp.maximum(kept - 1, 0)[:, None], 1)[:, 0]
    kept_any = kept > 0
    return d.replace(
        pending_features=jnp.where(kept_any[:, None, None], before.astype(
            d.pending_features.dtype), d.pending_features),
        pending_tokens=jnp.where(kept_any[:, None], jnp.take_along_axis(fed, path, 1),
                                 d.pending_tokens),
        pending=jnp.where(kept_any, kept, d.pending),
        feature=jnp.where(kept_any[:, None], features[rows, last].astype(d.feature.dtype),
                          d.feature))
