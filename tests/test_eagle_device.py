"""The EAGLE-style head's device side (`kvjax.speculative.eagle_tree_device`) against the
host drafter (`EagleTreeDrafter`), round by round under invariant numerics: the same trees,
node for node, and after a verify the head cache holding the pairs a host catch-up writes,
bitwise; with the head on XLA's products and attention and on kvjax's CPU kernels (the
plan the drafter is given). (The end-to-end loop: tests/test_eagle.py.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from eagle_helpers import markov, trained_head
from engine_helpers import CONFIG
from helpers import gather_sequence

from kvjax.config import CacheConfig
from kvjax.cpu.product import kernel
from kvjax.model.plan import INVARIANT
from kvjax.model.transformer import forward, head_logits, init_params
from kvjax.speculative.eagle import EagleHead, draft_head, embed, head_config
from kvjax.speculative.eagle_drafter import EagleTreeDrafter
from kvjax.speculative.eagle_tree_device import absorb, grow
from kvjax.speculative.tree_loop import tree_layout

MAX_NODES, DEPTH, TOP_K = 8, 3, 3
ON_KERNEL = dataclasses.replace(INVARIANT, cpu_kernel=True, cpu_attention=True)
needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = CONFIG  # the trained head's target
    target = init_params(config, seed=1)
    head = trained_head(tmp_path_factory)["head"]
    seq = markov(1, 40, config.vocab_size, 9)[0]
    feats = np.asarray(forward(target, config, seq[None], features=True, plan=INVARIANT)[0])
    return config, target, head, seq, feats


def _drafter(setup, plan=INVARIANT) -> EagleTreeDrafter:
    config, target, head, _, _ = setup
    return EagleTreeDrafter(head, target, config, CacheConfig(page_size=4, num_pages=32),
                            top_k=TOP_K, width=MAX_NODES, chunk=8, plan=plan)


_grow = jax.jit(lambda d, last, reach, config: grow(d, last, reach, MAX_NODES, DEPTH, TOP_K,
                                                   config, tree_layout),
                static_argnums=3)
_absorb = jax.jit(absorb)


def _tree(parents, tokens, nodes) -> tuple[list[int], list[int]]:
    n = int(nodes[0])
    return np.asarray(parents)[0, :n].tolist(), np.asarray(tokens)[0, :n].tolist()


def _root_offers(setup, m: int) -> list[int]:
    """The root's children a tree of the history seq[:m + 1] must have: the `TOP_K` best
    tokens after the head's full-sequence pass (no cache) over the pairs [F_j, e(h_{j+1})],
    j < m, the last one the root pair's (its draft distribution, best first)."""
    config, target, head, seq, feats = setup
    pred, _ = EagleHead(head_config(config), INVARIANT).apply(
        {"params": head.params}, feats[None, :m], embed(target, config, seq[None, 1:m + 1]),
        np.arange(m, dtype=np.int32)[None])
    logits = np.asarray(head_logits(config, pred[0, -1], draft_head(target, config,
                                                                     head.vocab)))
    return np.asarray(head.vocab)[np.argsort(-logits, kind="stable")[:TOP_K]].tolist()


@pytest.mark.parametrize(("kept", "plan"), [(1, INVARIANT), (3, INVARIANT),
                                            pytest.param(3, ON_KERNEL, marks=needs_kernel)],
                         ids=["1", "3", "3-cpu-kernel"])
def test_a_round_on_device_grows_the_host_s_trees_and_catches_up_as_the_host(setup, kept,
                                                                             plan):
    config, _, _, seq, feats = setup
    length = 20  # tokens cached: h_0 .. h_19; h_20 the root
    device, host = _drafter(setup, plan), _drafter(setup, plan)
    history = np.zeros((1, 64), np.int32)
    history[0, :length + 1] = seq[:length + 1]
    d = device.device_draft(history, np.asarray([length]), [feats[:length]], 16, DEPTH)
    d = d.replace(cache=device.pool.cache)
    parents, tokens, nodes, d = _grow(d, np.asarray([seq[length]], np.int32),
                                      np.asarray([DEPTH]), config)
    want = host.propose_tree(seq[:length + 1], MAX_NODES, DEPTH, features=feats[:length])
    assert _tree(parents, tokens, nodes) == tuple(want)
    assert int(nodes[0]) == MAX_NODES
    # the first level (the root's prediction, from the catch-up's extend) is the head's
    # full-sequence pass's: both sides agreeing is not enough
    assert want[1][1:1 + TOP_K] == _root_offers(setup, length)
    assert want[0][1:1 + TOP_K] == [0] * TOP_K
    # the nodes of the last level's pass (1 + 3 + 3: the last 1 is never run) in the head
    # cache past the cached pairs, bitwise: their inputs are their parents' predictions, so
    # this compares the predictions too, not only the tokens they rank first
    ran = length - 1 + 1 + 2 * TOP_K
    for a, b in zip(gather_sequence(d.cache, device._state[0][1], ran),
                    gather_sequence(host.pool.cache, host._state[0][1], ran), strict=True):
        np.testing.assert_array_equal(a, b)
    if plan is ON_KERNEL:  # the plan is honoured: the kernels' bits, not XLA's
        xla = _drafter(setup)
        xla.propose_tree(seq[:length + 1], MAX_NODES, DEPTH, features=feats[:length])
        a = gather_sequence(d.cache, device._state[0][1], ran)[0]
        b = gather_sequence(xla.pool.cache, xla._state[0][1], ran)[0]
        assert not np.array_equal(a, b)
        # the same head to rounding: measured 8.3e-7 (K/V up to 2.3)
        assert np.abs(a - b).max() < 1e-5

    # a verify that kept the root and kept - 1 drafts of a path through the tree's nodes
    # 0, 2, 5, 7 holding the history's own next tokens, with the target's features there
    # (the other nodes: other tokens and features)
    rng = np.random.default_rng(kept)
    path = np.asarray([[0, 2, 5, 7]], np.int32)
    fed = rng.integers(0, config.vocab_size, (1, MAX_NODES)).astype(np.int32)
    fed[0, path[0]] = seq[length:length + DEPTH + 1]
    node_feats = rng.normal(size=(1, MAX_NODES, config.d_model)).astype(np.float32)
    node_feats[0, path[0]] = feats[length:length + DEPTH + 1]
    now = length + kept
    d = _absorb(d, path, np.asarray([kept], np.int32), fed, node_feats)
    assert int(d.cached[0]) == length - 1 and int(d.pending[0]) == kept
    np.testing.assert_array_equal(np.asarray(d.feature[0]), feats[now - 1])

    # the next round: the pending pairs and the root pair in one extend (the root's
    # prediction the first level's offers), then the tree: the host's, node for node
    parents, tokens, nodes, d = _grow(d, np.asarray([seq[now]], np.int32),
                                      np.asarray([DEPTH]), config)
    want = host.propose_tree(seq[:now + 1], MAX_NODES, DEPTH, features=feats[:now])
    assert _tree(parents, tokens, nodes) == tuple(want)
    assert want[1][1:1 + TOP_K] == _root_offers(setup, now)
    assert int(d.cached[0]) == now - 1 and int(d.pending[0]) == 0
    # and the head cache holds the pairs the host's catch-up wrote, then the same tree
    # nodes, bitwise
    device_pages = device._state[0][1]
    host_pages = host._state[0][1]
    got = gather_sequence(d.cache, device_pages, now - 1 + 1 + 2 * TOP_K)
    ref = gather_sequence(host.pool.cache, host_pages, now - 1 + 1 + 2 * TOP_K)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(ref[0]).max() > 0.1


def test_a_row_near_its_budget_grows_a_shallower_tree(setup):
    config, _, _, seq, feats = setup
    device, host = _drafter(setup), _drafter(setup)
    history = np.zeros((1, 64), np.int32)
    history[0, :11] = seq[:11]
    d = dataclasses.replace(device.device_draft(history, np.asarray([10]), [feats[:10]], 16,
                                                DEPTH), cache=device.pool.cache)
    for reach in (0, 1, 2):
        parents, tokens, nodes, _ = _grow(d, np.asarray([seq[10]], np.int32),
                                          np.asarray([reach]), config)
        want = host.propose_tree(seq[:11], MAX_NODES, reach, features=feats[:10])
        assert _tree(parents, tokens, nodes) == tuple(want)
        assert len(want[0]) == 1 + TOP_K * reach


def test_the_host_drafter_grows_a_rewound_or_repeated_history_s_tree_afresh(setup):
    """A sequence's history may come back shorter (a rewound sequence) or unchanged: the
    root pair is fed again either way (its slot is scratch), so the tree is a fresh
    drafter's."""
    _, _, _, seq, feats = setup
    used, fresh = _drafter(setup), _drafter(setup)
    want = fresh.propose_tree(seq[:21], MAX_NODES, DEPTH, features=feats[:20])
    used.propose_tree(seq[:31], MAX_NODES, DEPTH, features=feats[:30])
    assert used.propose_tree(seq[:21], MAX_NODES, DEPTH, features=feats[:20]) == want
    assert used.propose_tree(seq[:21], MAX_NODES, DEPTH, features=feats[:20]) == want


@pytest.mark.parametrize("budget", [2, 4, 6])
def test_a_smaller_budget_grows_the_first_nodes_of_the_wider_tree(setup, budget):
    """What lets the engine's width policy score every narrower width from one verify
    (`tree_policy`): the tree grown within `budget` nodes is the first `budget` nodes of the
    tree grown within more, parents and tokens (a level's offers come best first, and the
    budget only cuts the last level short)."""
    config, _, _, seq, feats = setup
    device = _drafter(setup)
    history = np.zeros((1, 64), np.int32)
    history[0, :21] = seq[:21]
    d = dataclasses.replace(device.device_draft(history, np.asarray([20]), [feats[:20]], 16,
                                                DEPTH), cache=device.pool.cache)
    cut = jax.jit(lambda d, last, reach: grow(d, last, reach, budget, DEPTH, TOP_K, config,
                                              tree_layout))
    last, reach = np.asarray([seq[20]], np.int32), np.asarray([DEPTH])
    wide = _tree(*_grow(d, last, reach, config)[:3])
    narrow = _tree(*cut(d, last, reach)[:3])
    assert len(wide[0]) == MAX_NODES and len(narrow[0]) == budget
    assert narrow == (wide[0][:budget], wide[1][:budget])
