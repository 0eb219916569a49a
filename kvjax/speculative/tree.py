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


def ngram_continuations(history: Sequence[int], depth: int, max_ngram: int, min_ngram: int,
                        count: int) -> list[list[int]]:
    """Up to `count` different continuations (at most `depth` tokens each) of the history's
    last n-gram's earlier occurrences, n from `max_ngram` down to `min_ngram`, the most
    recent occurrence first."""
    h = np.asarray(history)
    out: list[list[int]] = []
    for n in range(min(max_ngram, len(h) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
        for start in np.flatnonzero((windows == h[-n:]).all(axis=1))[::-1]:
            follow = h[start + n: start + n + depth].tolist()
            if follow and follow not in out:
                out.append(follow)
            if len(out) == count:
                return out
    return out


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


class NGramTreeDrafter:
    """Prompt lookup as a tree: the tokens that followed earlier occurrences of the
    history's last n-gram (n from `max_ngram` down to `min_ngram`, the most recent
    occurrence first), up to `branches` different continuations, merged where they share a
    prefix: one root path per continuation."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 4):
        if not 1 <= min_ngram <= max_ngram or branches < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and branches >= 1, got "
                             f"{min_ngram}, {max_ngram}, {branches}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches

    def continuations(self, history: Sequence[int], depth: int) -> list[list[int]]:
        """Up to `branches` different continuations of at most `depth` tokens."""
        return ngram_continuations(history, depth, self.max_ngram, self.min_ngram,
                                   self.branches)

    def propose_tree(self, history: Sequence[int], max_nodes: int, depth: int,
                     seq_id: int = 0) -> tuple[list[int], list[int]]:
        """(parents, tokens) of a tree of at most `max_nodes` nodes whose root (node 0) is
        the history's newest token and whose paths are at most `depth` drafts long (the
        tree drafters' protocol; `seq_id` names the sequence for drafters with state)."""
        parents, tokens = [-1], [int(history[-1])]
        child: dict[tuple[int, int], int] = {}
        for chain in self.continuations(history, depth):
            node = 0
            for token in chain:
                if (node, token) not in child:
                    if len(tokens) == max_nodes:
                        break
                    child[node, token] = len(tokens)
                    parents.append(node)
                    tokens.append(token)
                node = child[node, token]
        return parents, tokens


def sampled_path(parents: Sequence[int], tokens: Sequence[int], p: np.ndarray,
                 q: Sequence[np.ndarray | None] | None, rng: np.random.Generator
                 ) -> tuple[list[int], int]:
    """Exact speculative sampling over a tree (SpecInfer's multi-step rule): (the accepted
    root path, the token that follows it).

    At the path's last node, its children are tested in order against the target's
    distribution there, `p[node]` (float[N, V]): child c (token x, drawn from `q[c]`, or
    deterministic when `q` or `q[c]` is None: one-hot) is accepted with probability
    min(1, r(x) / q_c(x)), r starting as p[node]; a rejection replaces r by
    norm(max(0, r - q_c)). An accepted child continues the path; when every child is
    rejected the next token is drawn from r. The emitted tokens are then distributed as
    the target's own samples, for deterministic children with distinct tokens and for
    children drawn independently from the same q.
    """
    path = [0]
    vocab = p.shape[1]
    while True:
        r = np.asarray(p[path[-1]], np.float64)
        for c in (i for i in range(1, len(parents)) if parents[i] == path[-1]):
            x = tokens[c]
            q_c = None if q is None else q[c]
            if q_c is None:
                q_c = np.zeros(vocab)
                q_c[x] = 1.0
            if rng.random() * q_c[x] < r[x]:
                path.append(c)
                break
            r = np.maximum(r - q_c, 0.0)
            r /= r.sum()
        else:
            return path, int(rng.choice(vocab, p=r))
