"""A draft model that proposes token trees, grown by cumulative draft probability (EAGLE-2's
rule). Host loop around the draft's jitted steps.

Per sequence the draft's own paged cache holds the history but its newest token (kept
across rounds: after a verify it keeps the longest prefix still on the history and prefills
the rest). A round grows the tree level by level: one tree extend of the draft over every
node so far (`BatchInfo.depth` / `ancestors`, the root being the newest token) gives each
frontier node's next-token distribution; every frontier node offers its `top_k` tokens,
scored by the path's cumulative log-probability, and the `top_k` best of all offers become
the next frontier, until the tree has `max_nodes` nodes or `depth` levels. The tree nodes
live in the draft cache's slots past the history and are overwritten by the next round.
"""

from __future__ import annotations

import numpy as np

from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table
from kvjax.model.plan import INVARIANT, NumericsPlan
from kvjax.speculative.drafters import catch_up
from kvjax.speculative.tree_host import tree_batch


def grow_tree(root: int, best_of, max_nodes: int, depth: int, top_k: int,
              rerank: bool = False) -> tuple[list[int], list[int], list[float]]:
    """(parents, tokens, path probabilities) of a tree grown from `root` by cumulative draft
    log-probability (module docstring); the root's path probability is 1.
    `best_of(parents, tokens)` gives the draft's `top_k` likeliest next tokens at every node
    of the tree so far, best first: (log-probabilities [nodes, top_k], token ids
    [nodes, top_k]). With `rerank` (EAGLE-2's final step) every level adds its `top_k`
    offers and the tree is the root and the max_nodes - 1 best nodes by score (ties: the
    earlier), in their order (`eagle_tree_device.rerank_nodes` on device)."""
    # float32 sums, as the device's trees add them (`eagle_tree_device.grow`): the same
    # order of offers, ties to the earlier (stable sort)
    budget, max_nodes = max_nodes, (max(max_nodes, 1 + top_k * depth) if rerank
                                    else max_nodes)
    parents, tokens, score = [-1], [int(root)], [np.float32(0)]
    frontier = [0]
    for _ in range(depth):
        if len(tokens) >= max_nodes or not frontier:
            break
        logp, ids = best_of(parents, tokens)
        offers = [(score[node] + np.float32(logp[node, c]), node, int(ids[node, c]))
                  for node in frontier for c in range(top_k)]
        offers.sort(key=lambda o: -o[0])
        frontier = []
        for s, node, token in offers[:min(top_k, max_nodes - len(tokens))]:
            frontier.append(len(tokens))
            parents.append(node)
            tokens.append(token)
            score.append(s)
    if rerank:  # a node's score is at most its parent's, which comes first: still a tree
        best = sorted(range(1, len(tokens)), key=lambda i: (-score[i], i))[:budget - 1]
        keep = [0, *sorted(best)]
        index = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [index[parents[i]] for i in keep[1:]]
        tokens, score = [tokens[i] for i in keep], [score[i] for i in keep]
    return parents, tokens, np.exp(np.asarray(score, np.float64)).tolist()


def best_tokens(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities [n, top_k], token ids [n, top_k]) of the `top_k` likeliest
    tokens of logits [n, V], best first (the lower id on ties), on the host."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=-1, kind="stable")[:, :top_k]
    return np.take_along_axis(logp, ids, axis=-1), ids


class ModelTreeDrafter:
    """Trees from a small kvjax model of the target's vocabulary (module docstring)."""

    def __init__(self, params, config: ModelConfig, cache_config: CacheConfig,
                 top_k: int = 2, width: int = 8, plan: NumericsPlan = INVARIANT):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.params, self.config, self.plan = params, config, plan
        self.pool = KVPool(config, cache_config)
        self.top_k, self.width = top_k, width  # width: the extend shape, >= max_nodes
        self._state: dict[int, tuple[list[int], list[int]]] = {}  # id -> (cached, pages)
        self.last_path_probs: list[float] = []  # the last tree's (`tree_policy`)

    def release(self, seq_id: int = 0) -> None:
        _, pages = self._state.pop(seq_id, ([], []))
        self.pool.release(pages)

    def propose_tree(self, history, max_nodes: int, depth: int, seq_id: int = 0
                     ) -> tuple[list[int], list[int]]:
        """(parents, tokens) of a tree of at most `max_nodes` nodes (the root, the history's
        newest token, included) and `depth` levels below the root."""
        if max_nodes > self.width:
            raise ValueError(f"max_nodes {max_nodes} > the drafter's width {self.width}")
        history = [int(t) for t in history]
        length, pages = self._catch_up(history, seq_id)
        parents, tokens, self.last_path_probs = grow_tree(
            history[-1], lambda parents, tokens: self._tree_logp(pages, length, parents,
                                                                 tokens),
            max_nodes, depth, self.top_k)
        return parents, tokens

    def _catch_up(self, history: list[int], seq_id: int) -> tuple[int, list[int]]:
        """The draft cache of `seq_id` holding history[:-1]; (its length, its pages)."""
        cached, pages = self._state.get(seq_id, ([], []))
        catch_up(self.pool, self.params, self.config, cached, pages, history, self.width,
                 self.plan)
        self._state[seq_id] = (history[:-1], pages)
        return len(history) - 1, pages

    def _tree_logp(self, pages, length: int, parents, tokens) -> tuple[np.ndarray,
                                                                        np.ndarray]:
        """The draft's `top_k` likeliest tokens at each node of the tree so far
        (`best_tokens`)."""
        table = page_table([pages], 1, self.pool.cache_config.block_pages)
        batch, fed = tree_batch(table, length, parents, tokens, self.width)
        logits = np.asarray(self.pool.run(lambda c: steps.extend(
            self.params, self.config, c, fed, batch, plan=self.plan)))[0]
        return best_tokens(logits[:len(tokens)], self.top_k)
