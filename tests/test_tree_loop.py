"""Tree speculation on device (`kvjax.speculative.tree_loop`): the n-gram trees are the host
drafter's, the layout and the greedy path are `tree_arrays`' and `greedy_path`'s, and
`device_tree_generate` emits plain greedy decoding's tokens with its logits bitwise under
invariant numerics, with the host tree loop's acceptance, call for call."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params

from kvjax.decode.generate import generate
from kvjax.model.plan import INVARIANT
from kvjax.speculative.ngram_tree_device import ngram_tree
from kvjax.speculative.tree import NGramTreeDrafter, greedy_path, tree_arrays
from kvjax.speculative.tree_host import device_tree_generate, tree_generate
from kvjax.speculative.tree_loop import accepted_within, greedy_tree_path, tree_layout


@pytest.fixture(scope="module")
def p():
    return params()


def _histories(seed: int, rows: int = 24) -> list[list[int]]:
    """Repetitive histories over a few tokens (many matches, shared prefixes), and short
    ones (no match, a lone token)."""
    rng = np.random.default_rng(seed)
    out = [[int(t) for t in rng.integers(1, 6, int(rng.integers(2, 40)))]
           for _ in range(rows - 2)]
    return out + [[3], [4, 5]]


@pytest.mark.parametrize(("max_nodes", "depth", "branches", "ngrams"),
                         [(8, 7, 4, (3, 1)), (6, 3, 3, (2, 1)), (10, 5, 6, (3, 2)),
                          (3, 2, 1, (1, 1))])
def test_device_trees_are_the_host_drafter_s(max_nodes, depth, branches, ngrams):
    histories = _histories(max_nodes)
    reach = np.random.default_rng(1).integers(0, depth + 2, len(histories)).astype(np.int32)
    width = 48
    table = np.zeros((len(histories), width), np.int32)
    for i, h in enumerate(histories):
        table[i, :len(h)] = h
    lengths = np.array([len(h) for h in histories], np.int32)
    parents, tokens, nodes = (np.asarray(x) for x in ngram_tree(
        table, lengths, reach, max_nodes, depth, branches, *ngrams))
    drafter = NGramTreeDrafter(max_ngram=ngrams[0], min_ngram=ngrams[1], branches=branches)
    sizes = set()
    for i, h in enumerate(histories):
        want_parents, want_tokens = drafter.propose_tree(h, max_nodes, min(depth, reach[i]))
        n = int(nodes[i])
        assert parents[i, :n].tolist() == want_parents, i
        assert tokens[i, :n].tolist() == want_tokens, i
        sizes.add(n)
    assert 1 in sizes and max_nodes in sizes and len(sizes) > 2  # lone roots, full trees


def test_an_n_gram_tree_holds_the_chain_of_its_budget_and_accepts_at_least_as_much():
    """At one verify cost (8 nodes, paths of up to 7 drafts) the tree's first root path is
    the chain's, and the other continuations fill what the chain leaves of the budget: for
    any target choices its greedy path is at least the chain's."""
    rng = np.random.default_rng(3)
    chain, tree = NGramTreeDrafter(branches=1), NGramTreeDrafter(branches=4)
    longer = wider = 0
    for h in _histories(5, rows=200):
        cp, ct = chain.propose_tree(h, 8, 7)
        tp, tt = tree.propose_tree(h, 8, 7)
        assert (tp[:len(cp)], tt[:len(ct)]) == (cp, ct)
        wider += len(tt) > len(ct)
        for _ in range(4):  # the target's argmax at each node: the chain's token, or not
            choice = np.where(rng.random(len(tt)) < 0.6, np.roll(tt, -1), rng.integers(1, 6,
                                                                                  len(tt)))
            got, base = len(greedy_path(tp, tt, choice)), len(greedy_path(cp, ct, choice))
            assert got >= base
            longer += got > base
    assert wider > 40 and longer > 20  # alternatives do get accepted (measured 81 and 41)


def test_layout_and_greedy_path_are_the_host_s():
    rng = np.random.default_rng(0)
    n, depth = 9, 8
    trees = [[-1], [-1, 0, 1, 2, 3, 4, 5, 6, 7], [-1] + [0] * 8]  # root, chain, star
    trees += [[-1] + [int(rng.integers(0, i)) for i in range(1, int(rng.integers(2, n + 1)))]
              for _ in range(20)]
    parents = np.full((len(trees), n), -1, np.int32)
    tokens = rng.integers(0, 3, (len(trees), n)).astype(np.int32)  # siblings share tokens
    choice = rng.integers(0, 3, (len(trees), n)).astype(np.int32)
    nodes = np.array([len(t) for t in trees], np.int32)
    for i, t in enumerate(trees):
        parents[i, :len(t)] = t
    got_depth, got_anc = (np.asarray(x) for x in tree_layout(parents, nodes))
    path, on_path = (np.asarray(x) for x in greedy_tree_path(parents, tokens, nodes, choice,
                                                             depth))
    lengths = set()
    for i, t in enumerate(trees):
        want_depth, want_anc = tree_arrays(t, n)
        np.testing.assert_array_equal(got_depth[i], want_depth)
        np.testing.assert_array_equal(got_anc[i], want_anc)
        want = greedy_path(t, tokens[i, :len(t)].tolist(), choice[i].tolist())
        assert path[i, :on_path[i]].tolist() == want, i
        lengths.add(len(want))
    assert len(lengths) > 2


def test_a_smaller_budget_builds_the_first_nodes_of_the_larger_tree():
    """What lets one verify tell the engine's width policy what every narrower tree would
    have accepted (`tree_policy.WidthPolicy`)."""
    histories = _histories(11, rows=40)
    table = np.zeros((len(histories), 48), np.int32)
    for i, h in enumerate(histories):
        table[i, :len(h)] = h
    lengths = np.array([len(h) for h in histories], np.int32)
    reach = np.full(len(histories), 7, np.int32)
    big_parents, big_tokens, big_nodes = (np.asarray(x) for x in ngram_tree(
        table, lengths, reach, 16, 7, 4, 3))
    assert big_nodes.max() == 16
    for w in (2, 3, 5, 8):
        parents, tokens, nodes = (np.asarray(x) for x in ngram_tree(
            table, lengths, reach, w, 7, 4, 3))
        np.testing.assert_array_equal(nodes, np.minimum(big_nodes, w))
        for i, n in enumerate(nodes):
            assert parents[i, :n].tolist() == big_parents[i, :n].tolist(), (w, i)
            assert tokens[i, :n].tolist() == big_tokens[i, :n].tolist(), (w, i)


def random_trees(rng, n: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(parents int32[3 + count, n] (-1 past a tree), nodes int32[3 + count]): a lone root,
    a chain and a star of n nodes, then `count` random trees of 2 to n nodes."""
    trees = [[-1], [-1, *range(n - 1)], [-1] + [0] * (n - 1)]
    trees += [[-1] + [int(rng.integers(0, i)) for i in range(1, int(rng.integers(2, n + 1)))]
              for _ in range(count)]
    parents = np.full((len(trees), n), -1, np.int32)
    for i, t in enumerate(trees):
        parents[i, :len(t)] = t
    return parents, np.array([len(t) for t in trees], np.int32)


def test_accepted_within_is_what_each_cut_tree_accepts():
    """For every width w, the drafts greedy acceptance emits from the tree's first w nodes,
    with and without a budget cutting the path (a stop id cuts the emitted count as a
    budget does: the cut tree's tokens are a prefix of the whole tree's)."""
    rng = np.random.default_rng(4)
    n, depth = 10, 9
    parents, nodes = random_trees(rng, n, 60)
    tokens = rng.integers(0, 2, parents.shape).astype(np.int32)  # deep paths accepted
    choice = rng.integers(0, 2, parents.shape).astype(np.int32)
    path, on_path = greedy_tree_path(parents, tokens, nodes, choice, depth)
    budget = rng.integers(0, depth + 2, len(parents)).astype(np.int32)  # 0: an idle row
    n_emit = np.minimum(np.asarray(on_path), budget)
    got = np.asarray(accepted_within(path, on_path, n_emit, n))
    longest = 0
    for w in range(1, n + 1):
        _, cut = greedy_tree_path(parents, tokens, np.minimum(nodes, w), choice, depth)
        want = np.maximum(np.minimum(np.asarray(cut), budget) - 1, 0)
        np.testing.assert_array_equal(got[:, w - 1], want, err_msg=f"width {w}")
        longest = max(longest, int(np.max(np.asarray(cut))))
    np.testing.assert_array_equal(got[:, -1], np.maximum(n_emit - 1, 0))  # the whole tree
    assert longest >= 4 and len(set(got[:, -1].tolist())) >= 3  # measured: 4, and 0..3 drafts


def _prompts() -> list[list[int]]:
    base = [int(t) for t in np.random.default_rng(7).integers(1, CONFIG.vocab_size, 6)]
    return [base * 4 + base[:2], [int(t) for t in np.random.default_rng(8).integers(
        1, CONFIG.vocab_size, 11)], base * 2]


def _same(got, want, host) -> None:
    """Tokens and logits bitwise `generate`'s; calls, drafts and acceptances the host's."""
    assert got.tokens == want.tokens == host.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert (got.target_calls, got.drafted, got.accepted) == (
        host.target_calls, host.drafted, host.accepted)


@pytest.mark.parametrize(("max_nodes", "max_depth"), [(8, None), (6, 3)])
def test_device_tree_speculation_is_plain_greedy_decoding_and_the_host_loop_s(
        p, max_nodes, max_depth):
    """The same trees, verified the same way, with every path length the depth allows."""
    prompts = _prompts()
    drafter = NGramTreeDrafter(branches=3)
    kw = dict(max_nodes=max_nodes, max_depth=max_depth, cache=CACHE)
    want = generate(p, CONFIG, prompts, 24, cache=CACHE, return_logits=True, plan=INVARIANT)
    got = device_tree_generate(p, CONFIG, prompts, 24, drafter, **kw)
    _same(got, want, tree_generate(p, CONFIG, prompts, 24, drafter, **kw))
    assert got.accepted > 0 and got.drafted > got.target_calls


def test_stop_ids_and_budgets_cut_a_round_as_the_host_loop_does(p):
    """A stop id the copying prompt first emits at its 10th token (mostly accepted drafts
    there), a stop id that is one prompt's first token (that row never runs a round), and
    one token per prompt (no round at all)."""
    prompts = _prompts()
    drafter = NGramTreeDrafter(branches=3)
    free = generate(p, CONFIG, prompts, 24, cache=CACHE, plan=INVARIANT)
    stop = free.tokens[0][9]
    assert stop not in free.tokens[0][:9]
    for stops, new in (((stop,), 24), ((free.tokens[1][0],), 24), ((), 1)):
        want = generate(p, CONFIG, prompts, new, cache=CACHE, return_logits=True,
                        plan=INVARIANT, stop_token=stops[0] if stops else None)
        got = device_tree_generate(p, CONFIG, prompts, new, drafter, cache=CACHE,
                                   stop_tokens=stops)
        _same(got, want, tree_generate(p, CONFIG, prompts, new, drafter, cache=CACHE,
                                       stop_tokens=stops))
        if stops == (stop,):
            assert len(got.tokens[0]) == 10 and got.accepted > 0
        else:
            assert min(len(t) for t in got.tokens) == 1


def test_the_device_loop_takes_n_gram_trees_only(p):
    with pytest.raises(ValueError, match="NGramTreeDrafter"):
        device_tree_generate(p, CONFIG, [[1, 2, 3]], 4, object(), cache=CACHE)
