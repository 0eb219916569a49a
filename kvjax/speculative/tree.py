"""Token trees for speculative verification: the host side. Host code: numpy.

A draft tree is its nodes' tokens and a parent index per node (-1 for the root, which is
the sequence's newest token, not yet cached; parents before children). One verify call runs
every node (`kvjax.cache.paged.BatchInfo`'s `depth` and `ancestors`): each sees the cache and
its ancestors only, at the position plain decoding would give it. A chain of γ drafts is
the tree whose node i has parent i - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def tree_arrays(parents: Sequence[int], width: int | None = None) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """(depth int32[width], ancestors int32[width, width]) of the tree `parents` (node i's
    parent, -1 for node 0, the root): ancestors[i, j] is node i's ancestor at depth j for
    j <= depth[i] (node i itself at its depth) and node i past it. Nodes past the tree
    (padding up to `width`) are roots of their own. Raises ValueError unless node 0 is the
    only root and every parent comes before its child."""
    n = len(parents)
    width = n if width is None else width
    if not n or parents[0] != -1 or n > width:
        raise ValueError(f"a tree is node 0 (parent -1) and at most {width} nodes; got "
                         f"parents {list(parents)}")
    depth = np.zeros(width, np.int32)
    ancestors = np.tile(np.arange(width, dtype=np.int32)[:, None], (1, width))
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i}'s parent {p} does not come before it")
        depth[i] = depth[p] + 1
        ancestors[i, :depth[i]] = ancestors[p, :depth[i]]
    return depth, ancestors


def greedy_path(parents: Sequence[int], tokens: Sequence[int], choice: Sequence[int]
                ) -> list[int]:
    """The nodes of the longest root path along which every child's token is the target's
    choice at its parent (`choice[i]`: the argmax of node i's logits), from the root (node
    0): the accepted drafts are the path's nodes past the root, and the token that follows
    them is `choice[path[-1]]`. Siblings with the same token: the first one counts."""
    path = [0]
    while True:
        nxt = next((i for i in range(1, len(parents))
                    if parents[i] == path[-1] and tokens[i] == choice[path[-1]]), None)
        if nxt is None:
            return path
        path.append(nxt)
