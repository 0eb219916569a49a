"""Tree verification in one extend call (`BatchInfo.depth` / `ancestors`): every node's
logits and K/V are bitwise those plain decoding computes for its root path, under invariant
numerics, for trees that cross pages and attention blocks, beside a row of another length."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, params, with_cache

from kvjax.cache.paged import BatchInfo, init_cache
from kvjax.decode import steps
from kvjax.model.plan import INVARIANT
from kvjax.speculative.tree import tree_arrays

PS = CACHE.page_size
TABLE = np.arange(3, 3 + 2 * 16, dtype=np.int32).reshape(2, 16)  # each row's pages
# row 0: a branching tree after 13 cached tokens (its nodes cross a page and a block);
# row 1: a chain of 4 after 6, padded to the width of 7
TREES = [[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2]]
LENGTHS = [13, 6]


@pytest.fixture(scope="module")
def p():
    return params()


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(1, CONFIG.vocab_size, n).astype(np.int32)


def _prefilled(fmt):
    """Each row's prompt in the cache (one call per row, as plain decoding starts from)."""
    cache = init_cache(CONFIG, with_cache(dtype=fmt))
    for r, n in enumerate(LENGTHS):
        batch = BatchInfo(page_table=TABLE[r:r + 1], lengths=np.zeros(1, np.int32),
                          num_new=np.asarray([n], np.int32))
        _, cache = steps.extend(params(), CONFIG, cache, _tokens(r, n)[None], batch,
                                plan=INVARIANT)
    return cache


def _slot(r, position):
    return TABLE[r, position // PS], position % PS


@pytest.mark.parametrize("fmt", ["float32", "int8", "bfloat16"])
def test_each_node_is_plain_decoding_of_its_root_path(p, fmt):
    """Float32, int8 (scales read with the numbers) and bfloat16 pages (bits on CPU)."""
    width = max(map(len, TREES))
    nodes = [_tokens(10 + r, width) for r in range(2)]
    arrays = [tree_arrays(parents, width) for parents in TREES]
    batch = BatchInfo(page_table=TABLE, lengths=np.asarray(LENGTHS, np.int32),
                      num_new=np.asarray([len(t) for t in TREES], np.int32),
                      depth=np.stack([d for d, _ in arrays]),
                      ancestors=np.stack([a for _, a in arrays]))
    logits, cache = steps.extend(p, CONFIG, _prefilled(fmt), np.stack(nodes), batch,
                                 plan=INVARIANT)
    logits = np.asarray(logits)
    checked = 0
    for r, parents in enumerate(TREES):
        depth, ancestors = arrays[r]
        leaves = [i for i in range(len(parents)) if i not in parents]
        for leaf in leaves:
            path = list(ancestors[leaf, :depth[leaf] + 1])
            plain = _prefilled(fmt)
            for j, node in enumerate(path):  # plain decoding: one token a call
                one = BatchInfo(page_table=TABLE[r:r + 1],
                                lengths=np.asarray([LENGTHS[r] + j], np.int32),
                                num_new=np.ones(1, np.int32))
                got, plain = steps.extend(p, CONFIG, plain, nodes[r][node][None, None], one,
                                          plan=INVARIANT)
                np.testing.assert_array_equal(logits[r, node], np.asarray(got[0, 0]))
                tree_page, tree_slot = _slot(r, LENGTHS[r] + node)
                page, slot = _slot(r, LENGTHS[r] + j)
                for name in ("k", "v", "k_scale", "v_scale")[:4 if fmt == "int8" else 2]:
                    np.testing.assert_array_equal(
                        np.asarray(getattr(cache, name)[:, :, tree_page, tree_slot]),
                        np.asarray(getattr(plain, name)[:, :, page, slot]))
                checked += 1
    assert checked == 3 + 3 + 4 + 4  # row 0: leaves 3, 5 and 6; row 1: its chain
