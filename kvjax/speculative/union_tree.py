"""One tree from two drafters: prompt lookup's continuations (an `NGramTreeDrafter`: free
to draft, long where an answer copies its context) and an EAGLE-style head's tree (where
it does not), verified in one call. Host code: plain Python.

The n-gram tree comes first, within all but `reserve` nodes of the budget; the head's tree
gets the nodes the n-gram tree left (so the two fit the budget together), and the two
merge as sets of root paths (`merge_trees`): a path both propose is one path. The
merge only picks which drafts are verified: the verify is the one every tree goes through,
so the answer is plain decoding's whatever the drafters propose.
"""

from __future__ import annotations

from collections.abc import Sequence

FIRST, SECOND, BOTH = 1, 2, 3  # which drafter proposed a node (`UnionTreeDrafter.sources`)


def merge_trees(first: tuple[Sequence[int], Sequence[int]],
                second: tuple[Sequence[int], Sequence[int]], max_nodes: int
                ) -> tuple[list[int], list[int], list[int]]:
    """(parents, tokens, sources) of the union of two trees' root paths (each tree given as
    (parents, tokens), node 0 the shared root, every parent before its children): the
    first tree's nodes in its order, then each of the second's that the first lacks, in the
    second's order, while fewer than `max_nodes` (a node left out leaves out its subtree).
    `sources[i]` is FIRST, SECOND or BOTH."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
    (pa, ta), (pb, tb) = first, second
    if int(ta[0]) != int(tb[0]):
        raise ValueError(f"the trees' roots differ: {ta[0]} and {tb[0]}")
    parents, tokens = [int(p) for p in pa[:max_nodes]], [int(t) for t in ta[:max_nodes]]
    sources = [FIRST] * len(tokens)
    sources[0] = BOTH
    child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    # the second tree's node -> its merged index; -1 for a node left out, whose children
    # then match no key and find no room either
    where = [0] + [-1] * (len(tb) - 1)
    for i in range(1, len(tb)):
        key = (where[int(pb[i])], int(tb[i]))
        if key in child:
            where[i] = child[key]
            sources[where[i]] = BOTH
        elif len(tokens) < max_nodes:
            where[i] = child[key] = len(tokens)
            parents.append(key[0])
            tokens.append(int(tb[i]))
            sources.append(SECOND)
    return parents, tokens, sources


class UnionTreeDrafter:
    """Trees of `ngram`'s continuations merged with `head`'s tree (module docstring): the
    n-gram tree within `max_nodes - reserve` nodes (at least the root), the head's within
    the rest (reserve + 1 nodes or more: the root and `reserve` drafts; all of them when
    max_nodes <= reserve). `head` is an `EagleTreeDrafter` (or any tree drafter; it gets
    the target's features when it reads them), kept as `second` (an `EagleTreeDrafter`'s
    own `head` is its parameters). `sources` holds the last tree's `merge_trees` sources.
    Host rounds only (`tree_generate`): the device loop drafts one kind of tree."""

    def __init__(self, ngram, head, reserve: int = 3):
        if reserve < 1:
            raise ValueError(f"reserve must be >= 1 (the root), got {reserve}")
        self.ngram, self.second, self.reserve = ngram, head, reserve
        self.reads_features = getattr(head, "reads_features", False)
        self.sources: list[int] = []

    def propose_tree(self, history, max_nodes: int, depth: int, seq_id: int = 0,
                     features=None) -> tuple[list[int], list[int]]:
        """(parents, tokens) of at most `max_nodes` nodes and `depth` levels (the tree
        drafters' protocol); `features` as `EagleTreeDrafter.propose_tree` takes them."""
        first = self.ngram.propose_tree(history, max(max_nodes - self.reserve, 1), depth,
                                        seq_id=seq_id)
        kw = {"features": features} if self.reads_features else {}
        # the nodes the n-gram tree left: together within max_nodes
        second = self.second.propose_tree(history, max_nodes - len(first[1]) + 1, depth,
                                        seq_id=seq_id, **kw)
        parents, tokens, self.sources = merge_trees(first, second, max_nodes)
        return parents, tokens

    def release(self, seq_id: int = 0) -> None:
        for drafter in (self.ngram, self.second):
            if hasattr(drafter, "release"):
                drafter.release(seq_id)
