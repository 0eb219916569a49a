"""Tree speculation on device: draft, verify, accept and compact inside one while_loop.

`kvjax.speculative.tree_host` runs a round per sequence from the host (a drafter in Python,
one extend call, the path moved into place, back to Python); here every round of every
sequence stays on device, as `kvjax.speculative.loop.spec_loop` does for chains:
  1. draft: each row's n-gram tree (`ngram_tree_device.ngram_tree`: the host
     `NGramTreeDrafter`'s trees) or EAGLE-style head's tree (`eagle_tree_device`: the host
     `EagleTreeDrafter`'s, the head's cache fed the verify's features), root = the newest
     token;
  2. verify: the target extends every row by its tree's nodes in one [B, N] call, each node
     seeing the cache and its ancestors only, at the position plain decoding gives it
     (`BatchInfo.depth` / `ancestors`);
  3. accept: a greedy row the longest root path whose every child is the target's argmax
     at its parent, then the target's own token; a sampled row by exact speculative
     sampling over the tree (`rules.tree_sampling_accept`: its tokens are distributed as
     the target's own samples); emitted within the budget, cut at a stop id;
  4. compact: the path's K/V move to the slots plain decoding writes (`move_slots`), the
     length drops to the kept history; the other nodes' K/V sit past it, where nothing
     reads them (a later write replaces them before any read).
Under invariant numerics every kept K/V and emitted logit equals plain decoding's, bitwise
(tests/test_tree_loop.py); sampled rows follow the target's distribution
(tests/test_tree_sampling.py).

Legend: B rows, N tree nodes (max_nodes), D depth, S tokens out per call, H history width.
"""

from __future__ import annotations

from functools import partial

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.paged import BatchInfo, model_positions, move_slots
from kvjax.config import ModelConfig
from kvjax.decode import steps
from kvjax.decode.aot import concrete, program
from kvjax.decode.sampling import greedy, probabilities
from kvjax.decode.state import DecodeState
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.model.transformer import Cache, Transformer
from kvjax.speculative.eagle_tree_device import (
    HeadDraft,
    absorb,
    grow,
    loop_state,
    with_fixed,
)
from kvjax.speculative.loop import emitted, one_of
from kvjax.speculative.ngram_tree_device import ngram_tree
from kvjax.speculative.rules import tree_sampling_accept, tree_uniforms


@flax.struct.dataclass
class TreeLoopResult:
    """What a tree call returns besides the cache."""

    tokens: jax.Array  # int32[B, S] (-1 past the end)
    logits: jax.Array | None  # float32[B, S, V] the target logits of each token
    lengths: jax.Array  # int32[B] tokens the target has cached
    rounds: jax.Array  # int32 target calls
    verifications: jax.Array  # int32[B] target calls that verified the row
    drafted: jax.Array  # int32[B] draft nodes verified
    accepted: jax.Array  # int32[B] drafts emitted
    drafted_by_depth: jax.Array  # int32[B, D] draft nodes verified at depth 1 .. D
    accepted_by_depth: jax.Array  # int32[B, D] drafts emitted at depth 1 .. D
    # int32[B, N]: [b, w - 1] the drafts row b's verifications would have emitted with
    # every tree cut to its first w nodes (`accepted_within`)
    accepted_by_width: jax.Array
    head: HeadDraft | None = None  # the EAGLE head's state (`loop_state`), where it drafted


@flax.struct.dataclass
class _Carry:
    round: jax.Array  # int32
    count: jax.Array  # int32[B] tokens emitted
    done: jax.Array  # bool[B]
    cache: Cache
    lengths: jax.Array  # int32[B]
    last: jax.Array  # int32[B]
    history: jax.Array  # int32[B, H]
    tokens: jax.Array  # int32[B, S]
    logits: jax.Array  # float32[B, S, V], or [0]
    verifications: jax.Array  # int32[B]
    drafted: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]
    drafted_by_depth: jax.Array  # int32[B, D]
    accepted_by_depth: jax.Array  # int32[B, D]
    accepted_by_width: jax.Array  # int32[B, N]
    head: HeadDraft | None


def tree_layout(parents: jax.Array, nodes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(depth int32[B, N], ancestors int32[B, N, N]) of each row's tree, as
    `kvjax.speculative.tree.tree_arrays` gives them: nodes past `nodes[b]` are roots of
    their own."""
    parents = jnp.asarray(parents)
    b, n = parents.shape
    rows = jnp.arange(b)
    cols = jnp.arange(n, dtype=jnp.int32)

    def node(i, carry):  # parents come first: a loop over the nodes, compiled once
        depth, ancestors = carry
        real = i < nodes
        parent = jnp.maximum(parents[:, i], 0)
        d = depth[rows, parent] + 1
        line = jnp.where(cols[None, :] < d[:, None], ancestors[rows, parent], i)
        return (depth.at[:, i].set(jnp.where(real, d, 0)),
                ancestors.at[:, i].set(jnp.where(real[:, None], line, ancestors[:, i])))

    return jax.lax.fori_loop(1, n, node, (jnp.zeros((b, n), jnp.int32), jnp.broadcast_to(
        cols[None, :, None], (b, n, n))))


def greedy_tree_path(parents: jax.Array, tokens: jax.Array, nodes: jax.Array,
                     choice: jax.Array, depth: int) -> tuple[jax.Array, jax.Array]:
    """(path int32[B, D + 1] (node 0 first; 0 past its end), its node count int32[B]) of
    `kvjax.speculative.tree.greedy_path` for each row: `choice` int32[B, N] is the target's
    argmax at each node."""
    parents, tokens, choice = jnp.asarray(parents), jnp.asarray(tokens), jnp.asarray(choice)
    b, n = parents.shape
    rows = jnp.arange(b)
    ids = jnp.arange(n, dtype=jnp.int32)[None, :]

    def down(j, carry):  # one level deeper per step
        path, at, going = carry
        child = ((parents == at[:, None]) & (tokens == choice[rows, at][:, None]) & (ids > 0)
                 & (ids < nodes[:, None]))
        going &= jnp.any(child, axis=1)
        at = jnp.where(going, jnp.argmax(child, axis=1).astype(jnp.int32), at)
        return path.at[:, j].set(jnp.where(going, at, 0)), at, going

    path, _, _ = jax.lax.fori_loop(1, depth + 1, down, (
        jnp.zeros((b, depth + 1), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)))
    return path, 1 + jnp.sum(path[:, 1:] > 0, axis=1).astype(jnp.int32)


def accepted_within(path: jax.Array, on_path: jax.Array, n_emit: jax.Array, max_nodes: int
                    ) -> jax.Array:
    """int32[B, N]: [b, w - 1] the drafts a verify of row b's tree cut to its first w nodes
    would have emitted. The path's nodes (`path` int32[B, D + 1], `on_path` of them) have
    growing indices, so the cut keeps the path's drafts below w, a prefix of it: greedy, as
    the argmax decides each child; sampled, as each node's test has its own uniform
    (`tree_uniforms`), the cut tree's children below w test as the whole tree's do. The
    budget and stop ids cut it as they cut the whole path (`n_emit` tokens, the last the
    target's own)."""
    drafts = jnp.arange(1, path.shape[1])[None, :] < on_path[:, None]  # [B, D]
    widths = jnp.arange(1, max_nodes + 1, dtype=jnp.int32)  # [N]
    within = jnp.sum(drafts[:, :, None] & (path[:, 1:, None] < widths), axis=1,
                     dtype=jnp.int32)  # [B, N]
    return jnp.minimum(within, jnp.maximum(n_emit - 1, 0)[:, None])


def sampled_rows(greedy_rows: tuple[jax.Array, jax.Array, jax.Array], logits: jax.Array,
                 parents: jax.Array, fed: jax.Array, nodes: jax.Array, tree_depth: jax.Array,
                 state: DecodeState, lengths: jax.Array, depth: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(path, node count, next token) per row: `greedy_rows`' (`greedy_tree_path`'s and the
    argmax after it) for temperature-0 rows, `tree_sampling_accept`'s for the others (the
    row's knobs on the logits [B, N, V]); no sampler runs when every row is greedy."""
    temperature, top_k, top_p = state.knobs

    def mixed():
        first = lengths + 1 + (0 if state.position_offset is None else state.position_offset)
        p = probabilities(logits, temperature, top_k, top_p)
        u = tree_uniforms(state.keys, first, tree_depth)
        drawn = tree_sampling_accept(parents, fed, nodes, p, u, state.keys, first, depth)
        pick = temperature > 0
        return tuple(jnp.where(pick.reshape(-1, *[1] * (g.ndim - 1)), s, g)
                     for s, g in zip(drawn, greedy_rows, strict=True))

    return jax.lax.cond(jnp.all(temperature == 0), lambda: greedy_rows, mixed)


def _check_width(*_, max_nodes: int, width=None, widths=None, head=None, **__) -> None:
    """A call's tree width must lie in [1, max_nodes] and `widths` hold max_nodes; an EAGLE
    head's trees have one width a program (`tree_loop`)."""
    widths = (max_nodes,) if widths is None else tuple(sorted(set(widths)))
    if widths[0] < 1 or widths[-1] != max_nodes:
        raise ValueError(f"verify widths must be in [1, max_nodes = {max_nodes}] and include "
                         f"it, got {widths}")
    if head is not None and widths != (max_nodes,):
        raise ValueError("an EAGLE head's trees verify at max_nodes only (widths)")
    value = max_nodes if width is None else concrete(width)
    if value is None:
        return
    if not 1 <= value <= max_nodes or (head is not None and value != max_nodes):
        raise ValueError(f"width must be in [1, max_nodes = {max_nodes}] (with a head, "
                         f"max_nodes), got {value}")


@program("tree_loop", {1: "cache", (0, "head", "cache"): "head_cache"},
         static_argnames=("config", "max_nodes", "widths", "depth", "branches", "max_out",
                          "ngram_max", "ngram_min", "top_k", "rerank", "return_logits",
                          "plan", "sampled"),
         donate_argnames=("cache", "head_cache"), check=_check_width)
def tree_loop(params, config: ModelConfig, cache, state: DecodeState, history: jax.Array, *,
              max_nodes: int, depth: int, width=None, widths: tuple[int, ...] | None = None,
              branches: int = 1, max_out: int, ngram_max: int = 3,
              ngram_min: int = 1, head: HeadDraft | None = None, head_cache=None,
              top_k: int = 4, rerank: bool = False, return_logits: bool = False,
              plan: NumericsPlan = FAST, sampled: bool = False
              ) -> tuple[TreeLoopResult, Cache]:
    """Emits up to `state.budget[b]` tokens per row by tree rounds on device.

    One program serves every n-gram tree width up to `max_nodes` (static, the arrays'
    width): `width` (traced; None: max_nodes) is this call's node budget, and each round
    verifies at the smallest of `widths` (static verify widths, default (max_nodes,))
    that holds it (`one_of`): the trees, tokens, K/V and statistics of a program
    compiled with max_nodes = width. An EAGLE head's trees take width = max_nodes.

    Donates `cache` and `head_cache` (the head's cache; `head.cache` is not read).
    `history` int32[B, H]: each row's tokens including `state.last`, H >= lengths +
    budget + 1. Each round verifies a tree of up to
    `max_nodes` nodes with paths of up to `depth` drafts: an n-gram tree (`branches`
    continuations: `NGramTreeDrafter`'s), or with `head` an EAGLE-style head's tree
    (`top_k` offers a level, `rerank`: EAGLE-2's cut of every level's offers to the best
    max_nodes; `EagleTreeDrafter`'s, see `eagle_tree_device`). A row's pages must hold
    lengths + budget + max_nodes - 1 slots (a round that drafts starts before count
    budget - 1) and its head pages lengths + budget + `candidates(...)` pairs. Rows with
    temperature 0 accept greedily; with `sampled` (static; without it no row samples and no
    sampler is compiled) the others sample by `state.keys` and knobs. No adapters. Returns
    (TreeLoopResult (with the head's side after the loop), the cache)."""
    if state.adapter_ids is not None:
        raise ValueError("tree_loop serves no LoRA adapters (state.adapter_ids is set)")
    b, vocab = state.last.shape[0], config.vocab_size
    widths = (max_nodes,) if widths is None else tuple(sorted(set(widths)))
    width = max_nodes if width is None else width
    rows = jnp.arange(b)
    cols = jnp.arange(depth + 1)[None, :]
    model = Transformer(config, plan=plan, features=head is not None)
    variables = partial(steps.model_variables, params, None, plan)  # called in the loop
    budget, stops = state.budget, state.stops
    zeros = jnp.zeros((b,), jnp.int32)
    carry = _Carry(
        round=jnp.int32(0), count=zeros, done=budget <= 0, cache=cache,
        lengths=state.lengths, last=state.last, history=history,
        tokens=jnp.full((b, max_out), -1, jnp.int32),
        logits=jnp.zeros((b, max_out, vocab) if return_logits else (0,), jnp.float32),
        verifications=zeros, drafted=zeros, accepted=zeros,
        drafted_by_depth=jnp.zeros((b, depth), jnp.int32),
        accepted_by_depth=jnp.zeros((b, depth), jnp.int32),
        accepted_by_width=jnp.zeros((b, max_nodes), jnp.int32),
        head=None if head is None else loop_state(head).replace(cache=head_cache))

    def body(s: _Carry) -> _Carry:
        active = ~s.done
        reach = jnp.maximum(budget - s.count - 1, 0)  # drafts that could still be emitted
        hd = None if head is None else with_fixed(s.head, head)
        if hd is None:
            parents, fed, nodes = ngram_tree(s.history, s.lengths + 1, reach, max_nodes,
                                             depth, branches, ngram_max, ngram_min, width)
        else:
            parents, fed, nodes, hd = grow(hd, s.last, jnp.where(active, reach, 0),
                                           max_nodes, depth, top_k, config, tree_layout,
                                           active, rerank)
        nodes = jnp.where(active, nodes, 0)
        tree_depth, ancestors = tree_layout(parents, nodes)

        def verify(w):  # the verify of the first `w` nodes: the argmax at each [B, N], its
            def run(cache):  # logits where read, and a head's features [B, N, D]; padded to N
                batch = BatchInfo(state.page_table, s.lengths, nodes, state.position_offset,
                                  depth=tree_depth[:, :w], ancestors=ancestors[:, :w, :w])
                out, cache = model.apply(variables(), fed[:, :w], model_positions(batch, w),
                                         cache, batch, state.adapter_ids)  # [B, w, V]
                logits, features = out if hd is not None else (out, None)
                pad = ((0, 0), (0, max_nodes - w))
                wide = lambda x: jnp.pad(x, (*pad, (0, 0)))  # noqa: E731
                full = wide(logits) if sampled or return_logits else None
                return (jnp.pad(greedy(logits), pad), full,
                        None if features is None else wide(features)), cache
            return run

        pick = jnp.sum(jnp.asarray(widths) < width)  # the smallest that holds the width
        (choice, logits, features), cache = one_of(pick, [verify(w) for w in widths],
                                                   s.cache)
        path, on_path = greedy_tree_path(parents, fed, nodes, choice, depth)
        end = jnp.take_along_axis(path, (on_path - 1)[:, None], 1)[:, 0]
        nxt = choice[rows, end]
        if sampled:
            path, on_path, nxt = sampled_rows((path, on_path, nxt), logits, parents, fed,
                                              nodes, tree_depth, state, s.lengths, depth)

        # Emit the path's drafts then nxt, within the budget, up to the first stop token.
        drafts = jnp.take_along_axis(fed, path, 1)  # [B, D + 1]; [:, 0] is the root
        out = jnp.where(cols < on_path[:, None] - 1, jnp.roll(drafts, -1, 1), 0)
        out = jnp.where(cols == on_path[:, None] - 1, nxt[:, None], out)
        n_emit, keep, stopped = emitted(out, on_path, budget - s.count, stops, active)
        at = jnp.where(keep, s.count[:, None] + cols, max_out)
        tokens = s.tokens.at[rows[:, None], at].set(out, mode="drop")
        out_logits = s.logits
        if return_logits:
            path_logits = jnp.take_along_axis(logits, path[:, :, None], 1)  # [B, D + 1, V]
            out_logits = s.logits.at[rows[:, None], at].set(path_logits, mode="drop")
        # the root and the emitted drafts are cached: their K/V to plain decoding's slots
        cache = move_slots(cache, state.page_table, s.lengths, path, n_emit)

        new_last = jnp.take_along_axis(out, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
        hist_at = jnp.where(keep, s.lengths[:, None] + 1 + cols, s.history.shape[1])
        history = s.history.at[rows[:, None], hist_at].set(out, mode="drop")
        count = s.count + n_emit
        levels = cols[:, 1:]  # [1, D]: depths 1 .. D
        real = jnp.arange(max_nodes)[None, :] < nodes[:, None]  # [B, N]
        at_level = (tree_depth[:, :, None] == levels[:, None, :]) & real[:, :, None]
        if hd is not None:
            hd = absorb(hd, path, n_emit, fed, features)
        return _Carry(
            round=s.round + 1, count=count, done=s.done | (count >= budget) | stopped,
            cache=cache, lengths=s.lengths + n_emit,
            last=jnp.where(n_emit > 0, new_last, s.last), history=history, tokens=tokens,
            logits=out_logits, verifications=s.verifications + active,
            drafted=s.drafted + jnp.maximum(nodes - 1, 0),
            accepted=s.accepted + jnp.maximum(n_emit - 1, 0),
            drafted_by_depth=s.drafted_by_depth + jnp.sum(at_level, axis=1, dtype=jnp.int32),
            accepted_by_depth=s.accepted_by_depth
            + (levels < n_emit[:, None]).astype(jnp.int32),
            accepted_by_width=s.accepted_by_width
            + accepted_within(path, on_path, n_emit, max_nodes),
            head=None if hd is None else loop_state(hd))

    end = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, carry)
    return TreeLoopResult(
        tokens=end.tokens, logits=end.logits if return_logits else None, lengths=end.lengths,
        rounds=end.round, verifications=end.verifications, drafted=end.drafted,
        accepted=end.accepted, drafted_by_depth=end.drafted_by_depth,
        accepted_by_depth=end.accepted_by_depth, accepted_by_width=end.accepted_by_width,
        head=end.head), end.cache
