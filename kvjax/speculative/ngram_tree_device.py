"""N-gram token trees on device: `NGramTreeDrafter.propose_tree`'s rule in pure JAX.

For each sequence: the tokens that followed earlier occurrences of its history's last
n-gram (n from `max_ngram` down to `min_ngram`, the most recent occurrence first), up to
`branches` different continuations, merged into a trie of at most `max_nodes` nodes whose
root (node 0) is the newest token; a continuation that needs a node past the budget stops
there. The same trees as the host drafter's (tests/test_tree_loop.py), so a device round
and a host round verify the same nodes.

Legend: B batch, H history buffer width, C candidate continuations (n values x H), D
depth (drafts on a path), K branches, N max_nodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.speculative.ngram_device import ngram_matches


def _candidates(history: jax.Array, hist_len: jax.Array, reach: jax.Array, depth: int,
                max_ngram: int, min_ngram: int) -> tuple[jax.Array, jax.Array]:
    """(tokens int32[B, C, D] (-1 past each length), lengths int32[B, C], 0: no match) of
    every earlier occurrence's continuation, in the drafter's order: n descending, then the
    most recent occurrence first. `reach` int32[B]: the most drafts a row may take."""
    b, h = history.shape
    idx = jnp.arange(h, dtype=jnp.int32)
    at_d = jnp.arange(depth, dtype=jnp.int32)
    tokens, lengths = [], []
    for n in range(max_ngram, min_ngram - 1, -1):
        match = ngram_matches(history, hist_len, n)
        follow = jnp.broadcast_to(idx + n, (b, h))  # where each continuation starts
        length = jnp.minimum(jnp.minimum(hist_len[:, None] - follow, reach[:, None]), depth)
        length = jnp.where(match, jnp.maximum(length, 0), 0)
        at = jnp.clip(follow[:, :, None] + at_d, 0, h - 1)  # [B, H, D]
        cont = jnp.take_along_axis(history, at.reshape(b, -1), axis=1).reshape(b, h, depth)
        cont = jnp.where(at_d < length[:, :, None], cont, -1)
        tokens.append(cont[:, ::-1])  # the most recent occurrence first
        lengths.append(length[:, ::-1])
    return jnp.concatenate(tokens, axis=1), jnp.concatenate(lengths, axis=1)


def _distinct(tokens: jax.Array, lengths: jax.Array, branches: int
              ) -> tuple[jax.Array, jax.Array]:
    """The first `branches` different continuations in order: (tokens int32[B, K, D],
    lengths int32[B, K], 0 where there are fewer)."""
    b, _, depth = tokens.shape
    rows = jnp.arange(b)

    def pick(k, carry):  # a loop, not K unrolled copies: compiled once
        taken, picked, picked_len = carry
        first = jnp.argmax(~taken, axis=1)  # [B] the first continuation not yet taken
        seq = tokens[rows, first]  # [B, D]
        n = jnp.where(jnp.any(~taken, axis=1), lengths[rows, first], 0)
        taken |= jnp.all(tokens == seq[:, None, :], axis=2) & (lengths == n[:, None])
        return taken, picked.at[:, k].set(seq), picked_len.at[:, k].set(n)

    _, picked, picked_len = jax.lax.fori_loop(0, branches, pick, (
        lengths == 0, jnp.zeros((b, branches, depth), jnp.int32),
        jnp.zeros((b, branches), jnp.int32)))
    return picked, picked_len


def ngram_tree(history: jax.Array, hist_len: jax.Array, reach: jax.Array, max_nodes: int,
               depth: int, branches: int, max_ngram: int, min_ngram: int = 1,
               budget: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(parents int32[B, N] (-1: the root and padding), tokens int32[B, N], nodes int32[B])
    of each row's tree; row b's history is history[b, :hist_len[b]], its root token the
    last of it; its paths hold at most min(depth, reach[b]) drafts. `budget` (traced int32,
    <= max_nodes; None: max_nodes) is the tree's node budget: the tree built with
    max_nodes = budget, in the first columns."""
    history = jnp.asarray(history)
    b = history.shape[0]
    rows = jnp.arange(b)
    cand, cand_len = _candidates(history, hist_len, reach, depth, max_ngram, min_ngram)
    chains, chain_len = _distinct(cand, cand_len, branches)
    chains = chains.reshape(b, branches * depth)
    node_ids = jnp.arange(max_nodes, dtype=jnp.int32)[None, :]
    root = jnp.take_along_axis(history, jnp.maximum(hist_len - 1, 0)[:, None], axis=1)[:, 0]
    budget = max_nodes if budget is None else budget

    def add(step, carry):  # token d of chain k, step = k * depth + d, in order
        parents, tokens, nodes, at, going = carry
        k, d = step // depth, step % depth
        at = jnp.where(d == 0, 0, at)  # a chain starts at the root
        going = ((d == 0) | going) & (d < chain_len[:, k])
        t = chains[:, step]
        child = ((parents == at[:, None]) & (tokens == t[:, None]) & (node_ids > 0)
                 & (node_ids < nodes[:, None]))
        exists = jnp.any(child, axis=1)
        new = going & ~exists & (nodes < budget)
        slot = jnp.where(new, nodes, max_nodes)  # out of range: dropped
        parents = parents.at[rows, slot].set(at, mode="drop")
        tokens = tokens.at[rows, slot].set(t, mode="drop")
        going &= exists | new  # past the budget the chain stops
        at = jnp.where(exists, jnp.argmax(child, axis=1).astype(jnp.int32), nodes)
        return parents, tokens, nodes + new.astype(jnp.int32), at, going

    parents, tokens, nodes, _, _ = jax.lax.fori_loop(0, branches * depth, add, (
        jnp.full((b, max_nodes), -1, jnp.int32),
        jnp.zeros((b, max_nodes), jnp.int32).at[:, 0].set(root), jnp.ones((b,), jnp.int32),
        jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)))
    return parents, tokens, nodes
