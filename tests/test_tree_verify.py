"""Tree verification in one extend call (`BatchInfo.depth` / `ancestors`): every node's
logits and K/V are bitwise those plain decoding computes for its root path, under invariant
numerics, for trees that cross pages and attention blocks, beside a row of another length."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params, with_cache

from kvjax.cache.paged import BatchInfo, init_cache, move_slots
from kvjax.cpu.product import kernel
from kvjax.decode import steps
from kvjax.model.plan import INVARIANT
from kvjax.speculative.tree import greedy_path, tree_arrays

PS = CACHE.page_size
CPU_ATTENTION = dataclasses.replace(INVARIANT, cpu_attention=True)  # products: XLA's
needs_kernel = pytest.mark.skipif(not kernel().available, reason=kernel().describe())
TABLE = np.arange(3, 3 + 2 * 16, dtype=np.int32).reshape(2, 16)  # each row's pages
# row 0: a branching tree after 21 cached tokens (its nodes cross a page and a block);
# row 1: a chain of 4 after 9, padded to the width of 7 (blocks before both trees are read
# once for every node, later ones per node)
TREES = [[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2]]
LENGTHS = [21, 9]


@pytest.fixture(scope="module")
def p():
    return params()


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, n).astype(np.int32)


def _prefilled(fmt, plan=INVARIANT):
    """Each row's prompt in the cache (one call per row, as plain decoding starts from)."""
    cache = init_cache(CONFIG, with_cache(dtype=fmt))
    for r, n in enumerate(LENGTHS):
        batch = BatchInfo(page_table=TABLE[r:r + 1], lengths=np.zeros(1, np.int32),
                          num_new=np.asarray([n], np.int32))
        _, cache = steps.extend(params(), CONFIG, cache, _tokens(r, n)[None], batch,
                                plan=plan)
    return cache


def _slot(r, position):
    return TABLE[r, position // PS], position % PS


def _trees():
    """(width, each row's node tokens, each row's (depth, ancestors), the verify's batch)."""
    width = max(map(len, TREES))
    nodes = [_tokens(10 + r, width) for r in range(2)]
    arrays = [tree_arrays(parents, width) for parents in TREES]
    batch = BatchInfo(page_table=TABLE, lengths=np.asarray(LENGTHS, np.int32),
                      num_new=np.asarray([len(t) for t in TREES], np.int32),
                      depth=np.stack([d for d, _ in arrays]),
                      ancestors=np.stack([a for _, a in arrays]))
    return width, nodes, arrays, batch


@pytest.mark.parametrize(("fmt", "plan"), [
    ("float32", INVARIANT), ("int8", INVARIANT), ("bfloat16", INVARIANT),
    ("float8_e4m3fn", INVARIANT),
    pytest.param("float32", CPU_ATTENTION, marks=needs_kernel, id="float32-cpu-attention"),
    pytest.param("bfloat16", CPU_ATTENTION, marks=needs_kernel, id="bfloat16-cpu-attention")])
def test_each_node_is_plain_decoding_of_its_root_path(p, fmt, plan):
    """Float32, int8 (scales read with the numbers), bfloat16 pages (bits on CPU) and
    float8 pages (bits and scales); XLA's attention, and kvjax's CPU attention kernel (a
    tree's slots read through `ancestors` in the kernel)."""
    _, nodes, arrays, batch = _trees()
    logits, cache = steps.extend(p, CONFIG, _prefilled(fmt, plan), np.stack(nodes), batch,
                                 plan=plan)
    logits = np.asarray(logits)
    checked = 0
    for r, parents in enumerate(TREES):
        depth, ancestors = arrays[r]
        leaves = [i for i in range(len(parents)) if i not in parents]
        for leaf in leaves:
            path = list(ancestors[leaf, :depth[leaf] + 1])
            plain = _prefilled(fmt, plan)
            for j, node in enumerate(path):  # plain decoding: one token a call
                one = BatchInfo(page_table=TABLE[r:r + 1],
                                lengths=np.asarray([LENGTHS[r] + j], np.int32),
                                num_new=np.ones(1, np.int32))
                got, plain = steps.extend(p, CONFIG, plain, nodes[r][node][None, None], one,
                                          plan=plan)
                np.testing.assert_array_equal(logits[r, node], np.asarray(got[0, 0]))
                tree_page, tree_slot = _slot(r, LENGTHS[r] + node)
                page, slot = _slot(r, LENGTHS[r] + j)
                for name in ("k", "v", "k_scale", "v_scale")[:2 if fmt == "bfloat16" or
                                                             fmt == "float32" else 4]:
                    np.testing.assert_array_equal(
                        np.asarray(getattr(cache, name)[:, :, tree_page, tree_slot]),
                        np.asarray(getattr(plain, name)[:, :, page, slot]))
                checked += 1
    assert checked == 3 + 3 + 4 + 4  # row 0: leaves 3, 5 and 6; row 1: its chain


def test_a_fast_tree_verify_is_plain_decoding_of_each_root_path_up_to_rounding(p):
    """Fast numerics tile a tree as a chain and mask it (`_tree_mask`): each node's logits
    are plain decoding's of its root path to rounding (no bitwise promise), so a node sees
    its ancestors at their positions and never a sibling or a later node."""
    from kvjax.model.plan import FAST

    def prefilled():
        cache = init_cache(CONFIG, with_cache())
        for r, n in enumerate(LENGTHS):
            batch = BatchInfo(page_table=TABLE[r:r + 1], lengths=np.zeros(1, np.int32),
                              num_new=np.asarray([n], np.int32))
            _, cache = steps.extend(p, CONFIG, cache, _tokens(r, n)[None], batch, plan=FAST)
        return cache

    _, nodes, arrays, batch = _trees()
    logits = np.asarray(steps.extend(p, CONFIG, prefilled(), np.stack(nodes), batch,
                                     plan=FAST)[0])
    worst, spread = 0.0, 0.0
    for r, parents in enumerate(TREES):
        depth, ancestors = arrays[r]
        for node in range(len(parents)):
            path = list(ancestors[node, :depth[node] + 1])
            fed = np.asarray([[nodes[r][i] for i in path]])
            chain = BatchInfo(page_table=TABLE[r:r + 1],
                              lengths=np.asarray([LENGTHS[r]], np.int32),
                              num_new=np.asarray([len(path)], np.int32))
            want = np.asarray(steps.extend(p, CONFIG, prefilled(), fed, chain,
                                           plan=FAST)[0])[0, -1]
            worst = max(worst, float(np.abs(logits[r, node] - want).max()))
            spread = max(spread, float(np.abs(want).max()))
    # measured 3.3e-6 (logits up to 11.5); with every tree slot visible (siblings and
    # later nodes leaking in) 4.1
    assert worst < 5e-5 and spread > 1.0


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_the_accepted_path_moved_into_place_decodes_on_as_plain_decoding(p, fmt):
    """Greedy acceptance over the tree (the drafts chosen so that the target's argmax
    accepts a path of depth 2 in row 0 and the whole chain in row 1), its K/V (int8: and
    scales) moved to the slots plain decoding writes, then one plain decode step of the
    token that follows: the moved K/V and that step's logits are bitwise those of plain
    decoding the path."""
    width, nodes, _, batch = _trees()
    # the drafts on 0 -> 2 -> 5 (row 0) and the chain (row 1) made the target's choices,
    # one depth more per call (a node's logits depend on its ancestors' tokens only)
    for _ in range(3):
        first, _ = steps.extend(p, CONFIG, _prefilled(fmt), np.stack(nodes), batch,
                                plan=INVARIANT)
        choice = np.asarray(first).argmax(-1)
        for r, path in ((0, [0, 2, 5]), (1, [0, 1, 2, 3])):
            for parent, child in itertools.pairwise(path):
                nodes[r][child] = choice[r, parent]
        nodes[0][1] = (choice[0, 0] + 1) % CONFIG.vocab_size  # 0's other child: rejected
    logits, cache = steps.extend(p, CONFIG, _prefilled(fmt), np.stack(nodes), batch,
                                 plan=INVARIANT)
    choice = np.asarray(logits).argmax(-1)
    paths = [greedy_path(parents, nodes[r], choice[r]) for r, parents in enumerate(TREES)]
    assert paths == [[0, 2, 5], [0, 1, 2, 3]]
    src = np.zeros((2, width), np.int32)
    for r, path in enumerate(paths):
        src[r, :len(path)] = path
    cache = move_slots(cache, TABLE, np.asarray(LENGTHS, np.int32), src,
                       np.asarray([len(q) for q in paths], np.int32))
    for r, path in enumerate(paths):
        plain = _prefilled(fmt)
        for j, node in enumerate(path + [None]):
            token = choice[r, path[-1]] if node is None else nodes[r][node]
            one = BatchInfo(page_table=TABLE[r:r + 1],
                            lengths=np.asarray([LENGTHS[r] + j], np.int32),
                            num_new=np.ones(1, np.int32))
            want, plain = steps.extend(p, CONFIG, plain, np.asarray([[token]]), one,
                                       plan=INVARIANT)
            moved = _slot(r, LENGTHS[r] + j)
            if node is not None:
                for name in ("k", "v", "k_scale", "v_scale")[:4 if fmt == "int8" else 2]:
                    np.testing.assert_array_equal(
                        np.asarray(getattr(cache, name)[:, :, moved[0], moved[1]]),
                        np.asarray(getattr(plain, name)[:, :, moved[0], moved[1]]))
        got, cache = steps.extend(p, CONFIG, cache, np.asarray([[token]]), one, plan=INVARIANT)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tree_arrays_and_their_refusals():
    depth, ancestors = tree_arrays([-1, 0, 0, 1], width=5)
    assert depth.tolist() == [0, 1, 1, 2, 0]
    assert ancestors[3, :3].tolist() == [0, 1, 3] and ancestors[2, :2].tolist() == [0, 2]
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], []):
        with pytest.raises(ValueError, match="a tree is|comes before|does not come"):
            tree_arrays(bad)
    assert greedy_path([-1, 0, 0, 2], [9, 4, 5, 6], [5, 0, 6, 7]) == [0, 2, 3]
    assert greedy_path([-1, 0], [9, 4], [5, 0]) == [0]


def test_tree_speculation_emits_plain_greedy_decodings_tokens_and_logits(p):
    """`tree_generate` with the n-gram tree drafter against `generate` under the same
    invariant plan: the same tokens and logits, bitwise, with drafts accepted on a
    repetitive prompt and several branches verified per call."""
    from kvjax.decode.generate import generate
    from kvjax.speculative.tree import NGramTreeDrafter
    from kvjax.speculative.tree_host import tree_generate

    base = [int(t) for t in _tokens(7, 6)]
    prompts = [base * 4 + base[:2], [int(t) for t in _tokens(8, 11)]]
    want = generate(p, CONFIG, prompts, 24, cache=CACHE, return_logits=True, plan=INVARIANT)
    got = tree_generate(p, CONFIG, prompts, 24, NGramTreeDrafter(branches=3), max_nodes=8,
                        cache=CACHE)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert got.accepted > 0 and got.drafted > got.target_calls
    stop = want.tokens[0][9]  # a sequence ends after its stop token, as generate's does
    cut = generate(p, CONFIG, prompts, 24, cache=CACHE, stop_token=stop, plan=INVARIANT)
    assert tree_generate(p, CONFIG, prompts, 24, NGramTreeDrafter(branches=3), max_nodes=8,
                         cache=CACHE, stop_tokens=(stop,)).tokens == cut.tokens
    assert len(cut.tokens[0]) <= 10


def test_sampled_tree_speculation_is_reproducible_and_top_1_is_greedy(p):
    """Sampled acceptance (its exactness: tests/test_tree_rules.py) through the whole loop:
    a seed gives the same tokens twice, another seed others; top_k = 1 gives greedy's."""
    from kvjax import SamplingConfig
    from kvjax.speculative.tree import NGramTreeDrafter
    from kvjax.speculative.tree_host import tree_generate

    base = [int(t) for t in _tokens(7, 6)]
    prompts = [base * 4 + base[:2]]

    def run(**kw):
        return tree_generate(p, CONFIG, prompts, 16, NGramTreeDrafter(branches=3),
                             max_nodes=8, cache=CACHE, sampling=SamplingConfig(**kw)).tokens

    assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
    assert run(temperature=1.0, seed=3) != run(temperature=1.0, seed=4)
    greedy = tree_generate(p, CONFIG, prompts, 16, NGramTreeDrafter(branches=3),
                           max_nodes=8, cache=CACHE).tokens
    assert run(temperature=1.0, top_k=1, seed=5) == greedy


def test_a_draft_model_tree_drafter_grown_by_cumulative_probability(p):
    """The draft model is the target itself, so its top-1 chain is the target's greedy path:
    4 drafts accepted per call. With top-3 the rule keeps the 3 likeliest paths per level
    (8 nodes: 3 levels), which may drop the greedy path: fewer accepted per call, still
    more than one. Either way the target's tokens and logits, bitwise."""
    from kvjax.decode.generate import generate
    from kvjax.speculative.tree_host import tree_generate
    from kvjax.speculative.tree_model import ModelTreeDrafter

    prompts = [[int(t) for t in _tokens(9, 13)]]
    want = generate(p, CONFIG, prompts, 20, cache=CACHE, return_logits=True, plan=INVARIANT)
    calls = {}
    for top_k in (1, 3):
        drafter = ModelTreeDrafter(p, CONFIG, CACHE, top_k=top_k, width=8)
        got = tree_generate(p, CONFIG, prompts, 20, drafter, max_nodes=8, max_depth=4,
                            cache=CACHE)
        assert got.tokens == want.tokens
        np.testing.assert_array_equal(got.logits[0], np.asarray(want.logits[0]))
        calls[top_k] = got.target_calls
    assert calls[1] == 4  # 19 tokens after the prefill's, 5 a call
    assert calls[3] < 19 // 2  # measured 6


def test_a_tree_verify_and_its_compaction_write_only_the_tree_s_slots(p):
    """Every slot of the pool but each row's L .. L + nodes - 1 keeps its bits through the
    verify and the move (pages wholly before L, which a trie may share, are never
    written); the rejected nodes' slots past the kept path, poisoned with NaN, change
    nothing of the next step: they leave no trace."""
    width, nodes, _, batch = _trees()
    before = _prefilled("float32")
    old_k, old_v = np.asarray(before.k), np.asarray(before.v)
    logits, cache = steps.extend(p, CONFIG, before, np.stack(nodes), batch, plan=INVARIANT)
    choice = np.asarray(logits).argmax(-1)
    paths = [[0, 2], [0, 1]]  # kept: 2 of 7 nodes in row 0, 2 of 4 in row 1
    src = np.zeros((2, width), np.int32)
    for r, path in enumerate(paths):
        src[r, :len(path)] = path
    cache = move_slots(cache, TABLE, np.asarray(LENGTHS, np.int32), src,
                       np.asarray([len(q) for q in paths], np.int32))
    k, v = np.asarray(cache.k).copy(), np.asarray(cache.v).copy()
    tree_slots = {_slot(r, LENGTHS[r] + i) for r in range(2) for i in range(len(TREES[r]))}
    untouched = np.ones(k.shape[2:4], bool)  # [pages, page_size]
    for page, slot in tree_slots:
        untouched[page, slot] = False
    np.testing.assert_array_equal(k[:, :, untouched], old_k[:, :, untouched])
    np.testing.assert_array_equal(v[:, :, untouched], old_v[:, :, untouched])
    assert (k[:, :, ~untouched] != old_k[:, :, ~untouched]).any()  # the tree was written
    for r, path in enumerate(paths):  # poison what was rejected, then decode on
        for i in range(len(path), len(TREES[r])):
            page, slot = _slot(r, LENGTHS[r] + i)
            k[:, :, page, slot] = np.nan
            v[:, :, page, slot] = np.nan
    poisoned = cache.replace(k=k, v=v)
    for r, path in enumerate(paths):
        one = BatchInfo(page_table=TABLE[r:r + 1],
                        lengths=np.asarray([LENGTHS[r] + len(path)], np.int32),
                        num_new=np.ones(1, np.int32))
        token = np.asarray([[choice[r, path[-1]]]], np.int32)
        clean, cache = steps.extend(p, CONFIG, cache, token, one, plan=INVARIANT)
        dirty, poisoned = steps.extend(p, CONFIG, poisoned, token, one, plan=INVARIANT)
        assert np.isfinite(np.asarray(dirty)).all()
        np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


class _RandomTrees:
    """Random trees over a known greedy answer: each node's parent is drawn among the
    nodes before it (or set by `shape`: "chain", "star", "root"); a node whose parent's
    path follows the answer carries the answer's next token half of the time, else a
    random one, so paths of every length are accepted and rejected."""

    def __init__(self, prompt, answer, shape, seed):
        self.full = list(prompt) + list(answer)
        self.shape, self.rng = shape, np.random.default_rng(seed)

    def propose_tree(self, history, max_nodes, depth, seq_id=0):
        n = 1 if self.shape == "root" else int(self.rng.integers(1, max_nodes + 1))
        parents, tokens, on_path, level = [-1], [int(history[-1])], [True], [0]
        for i in range(1, n):
            p = {"chain": i - 1, "star": 0}.get(self.shape, int(self.rng.integers(0, i)))
            if level[p] >= depth:
                break
            at = len(history) + level[p]
            right = on_path[p] and at < len(self.full) and self.rng.random() < 0.5
            token = self.full[at] if right else int(self.rng.integers(1, CONFIG.vocab_size))
            parents.append(p)
            tokens.append(token)
            on_path.append(right)
            level.append(level[p] + 1)
        return parents, tokens


@pytest.mark.parametrize("shape", ["random", "chain", "star", "root"])
def test_random_and_degenerate_trees_emit_plain_greedy_decoding(p, shape):
    """Trees of random shape (and a chain, all siblings, the root alone) drawn anew every
    call, against plain greedy decoding under invariant numerics: the same tokens and
    logits, bitwise, with drafts accepted wherever a tree has more than its root."""
    from kvjax.decode.generate import generate
    from kvjax.speculative.tree_host import tree_generate

    prompts = [[int(t) for t in _tokens(20 + i, 5 + 9 * i)] for i in range(2)]
    want = generate(p, CONFIG, prompts, 20, cache=CACHE, return_logits=True, plan=INVARIANT)
    for i, prompt in enumerate(prompts):
        drafter = _RandomTrees(prompt, want.tokens[i], shape, seed=i)
        got = tree_generate(p, CONFIG, [prompt], 20, drafter, max_nodes=8, cache=CACHE)
        assert got.tokens[0] == want.tokens[i]
        np.testing.assert_array_equal(got.logits[0], np.asarray(want.logits[i]))
        assert (got.accepted > 0) == (shape != "root")
