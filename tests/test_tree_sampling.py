"""Exact speculative sampling over token trees on device: `tree_loop`'s sampled rows emit
tokens distributed as the target's own samples (`rules.tree_sampling_accept`).

The statistics, target, knobs and thresholds are tests/test_spec_sampling.py's (vocabulary
8, temperature 0.8, top-k 6, top-p 0.9, 4,096 rows of 5 new tokens; total-variation
distances of each token's marginal and each consecutive pair's joint against the float64
reference over all 8^5 continuations, each over its 99.9th percentile for exact samples).
The prompt is made of the tokens the target favours (3, 5, 6) and repeats them, so n-gram
trees (up to 8 nodes, 3 branches, paths of 3) branch in every round that finds a match (1.5
nodes at depth 1 per verification): first children rejected and their siblings tested,
paths accepted to depth 2, the residual drawn after rejections and the bonus after a leaf.
Rules that test every child against the target's own distribution (no mass taken out) or
test siblings with one uniform fail the same test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import prefill
from test_spec_sampling import (
    CONFIG,
    NEW,
    ROWS,
    TEMP,
    TOP_K,
    TOP_P,
    _distances,
    _sharp,
    references,
)

from kvjax import CacheConfig, SamplingConfig, init_cache
from kvjax.decode import steps
from kvjax.decode.sampling import sequence_keys
from kvjax.decode.state import decode_state
from kvjax.model.plan import FAST, INVARIANT
from kvjax.speculative import rules
from kvjax.speculative import tree_loop as loop_module
from kvjax.speculative.tree_loop import tree_loop

PROMPT = [3, 5, 6, 3, 3, 6, 3, 5, 3]  # 8 cached (two full pages, shared), then the root
MAX_NODES, DEPTH, BRANCHES = 8, 3, 3


@pytest.fixture(scope="module")
def target():
    return _sharp(2)


@pytest.fixture(scope="module")
def reference(target):
    return references(target, _sharp(9), PROMPT)


def _start(target, rows: int, greedy_rows: int = 0, plan=FAST):
    """(cache, state, history) of `rows` rows after PROMPT; the first `greedy_rows` greedy."""
    cc = CacheConfig(page_size=4, num_pages=3 + 3 * rows, prefill_chunk=16, attn_block=4)
    _, cache = prefill(target, CONFIG, cc, init_cache(CONFIG, cc), PROMPT[:8], [1, 2],
                       plan=plan)
    # pages 1 and 2 (the 8 cached tokens) are every row's, read-only; 3 of its own after
    table = np.array([[1, 2, 3 + 3 * i, 4 + 3 * i, 5 + 3 * i] for i in range(rows)], np.int32)
    full = lambda x: np.full(rows, x, np.int32)  # noqa: E731
    knobs = SamplingConfig(temperature=TEMP, top_k=TOP_K, top_p=TOP_P)
    state = decode_state(table, full(8), full(PROMPT[8]), full(NEW), sequence_keys(0, rows),
                         [None] * greedy_rows + [knobs] * (rows - greedy_rows))
    history = np.zeros((rows, 16), np.int32)
    history[:, :len(PROMPT)] = PROMPT
    return cache, state, history


def _tree_tokens(target, greedy_rows: int = 0) -> tuple[np.ndarray, object]:
    """ROWS rows of `tree_loop` from PROMPT; the first `greedy_rows` rows greedy."""
    cache, state, history = _start(target, ROWS, greedy_rows)
    out, _ = tree_loop(target, CONFIG, cache, state, history, max_nodes=MAX_NODES,
                       depth=DEPTH, branches=BRANCHES, max_out=NEW, sampled=True)
    return np.asarray(out.tokens), jax.tree.map(np.asarray, out)


def test_sampled_trees_follow_the_target_distribution(target, reference):
    tokens, out = _tree_tokens(target)
    assert (tokens >= 0).all()
    # trees were drafted and branched, accepted in part, down to the deepest level
    assert out.drafted_by_depth[:, 0].sum() > out.verifications.sum()  # > 1 node a level
    assert 0 < out.accepted.sum() < out.drafted.sum()
    assert out.accepted_by_depth[:, 1].sum() > 1000  # measured 2,420 of 12,097 verifications
    assert _distances(reference, tokens).max() < 1  # measured 0.79
    want, thresholds, draft_stats = reference
    far = [0.5 * np.abs(d - w).sum() / t for d, w, t in zip(draft_stats, want, thresholds,
                                                             strict=True)]
    assert min(far) > 10  # measured 27: the test tells another model from the target


def test_greedy_rows_beside_sampled_ones_stay_greedy(target):
    """A call mixing rows: the greedy rows' tokens are the all-greedy call's."""
    tokens, _ = _tree_tokens(target, greedy_rows=ROWS // 2)
    cc_tokens, _ = _tree_tokens(target, greedy_rows=ROWS)
    np.testing.assert_array_equal(tokens[:ROWS // 2], cc_tokens[:ROWS // 2])
    assert len({tuple(t) for t in tokens[ROWS // 2:]}) > 100  # the sampled ones differ


@pytest.mark.parametrize("wrong", ["no-residual", "shared-uniforms"])
def test_a_wrong_tree_rule_fails_the_same_test(target, reference, swapped, wrong):
    """Testing every child against the target's own distribution (no mass taken out after
    a rejection), or testing siblings with one uniform: each fails the same test."""
    if wrong == "no-residual":
        swapped(rules, "reject", lambda r, x: r)
    else:
        def per_depth(keys, positions, depth):  # [B, N]: each node the first's at its depth
            first = jnp.argmax(depth[:, :, None] == depth[:, None, :], axis=-1)
            return jnp.take_along_axis(rules.tree_uniforms(keys, positions, depth), first, 1)
        swapped(loop_module, "tree_uniforms", per_depth)
    tokens, _ = _tree_tokens(target)
    assert _distances(reference, tokens).max() > 2  # measured 11.7 and 3.0


def test_accepted_within_holds_for_sampled_paths():
    """A sampled verify of a tree cut to its first w nodes, with the same uniforms, accepts
    the whole tree's path's drafts below w (each node's test has its own uniform, and a cut
    tree's children test as the whole tree's do): `accepted_within` is what every cut
    accepts, for sampled rows as for greedy ones (the adaptive widths' statistics)."""
    from test_tree_loop import random_trees

    from kvjax.speculative.tree_loop import accepted_within, tree_layout

    rng = np.random.default_rng(4)
    n, depth, vocab = 10, 9, 3
    parents, nodes = random_trees(rng, n, 200)
    rows = len(parents)
    tokens = rng.integers(0, vocab, parents.shape).astype(np.int32)
    p = rng.dirichlet(np.ones(vocab) * 0.3, (rows, n)).astype(np.float32)  # peaked
    keys = np.asarray(sequence_keys(1, rows))
    first = rng.integers(0, 50, rows).astype(np.int32)
    u = rules.tree_uniforms(keys, first, tree_layout(parents, nodes)[0])
    path, on_path, _ = rules.tree_sampling_accept(parents, tokens, nodes, p, u, keys, first,
                                                  depth)
    budget = rng.integers(0, depth + 2, rows).astype(np.int32)  # 0: an idle row
    n_emit = np.minimum(np.asarray(on_path), budget)
    got = np.asarray(accepted_within(path, on_path, n_emit, n))
    for w in range(1, n + 1):
        cut_nodes = np.minimum(nodes, w)
        cut_u = rules.tree_uniforms(keys, first, tree_layout(parents, cut_nodes)[0])
        _, cut, _ = rules.tree_sampling_accept(parents, tokens, cut_nodes, p, cut_u, keys,
                                               first, depth)
        want = np.maximum(np.minimum(np.asarray(cut), budget) - 1, 0)
        np.testing.assert_array_equal(got[:, w - 1], want, err_msg=f"width {w}")
    assert np.max(np.asarray(on_path)) >= 4 and len(set(got[:, -1].tolist())) >= 3


def test_a_tree_of_the_root_alone_samples_as_plain_decoding(target):
    """Trees of one node (the root: nothing drafted) draw each token as plain sampling draws
    the token at its position: the same key (`fold_in(key, position)`) on the same
    distribution (invariant numerics: the same logits), so the same tokens, which pins the
    positions the tree rule folds in."""
    rows = 512
    cache, state, history = _start(target, rows, plan=INVARIANT)
    tree, _ = tree_loop(target, CONFIG, cache, state, history, max_nodes=1, depth=1,
                        max_out=NEW, sampled=True, plan=INVARIANT)
    cache, state, _ = _start(target, rows, plan=INVARIANT)
    plain, _ = steps.decode_loop(target, CONFIG, cache, state, NEW, plan=INVARIANT)
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(plain.tokens))
    assert len({tuple(t) for t in np.asarray(plain.tokens)}) > 100  # sampled, not greedy
