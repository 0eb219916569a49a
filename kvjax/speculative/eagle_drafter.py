"""Token trees from an EAGLE-style head (`kvjax.speculative.eagle`): the drafter that reads
the target's features. Host loop around the head's jitted step.

Let the history be h_0 .. h_m (h_m the newest token, the tree's root) and F_j the target's
feature at h_j (j < m, handed in by the tree loop). The head's paged cache (a pool of one
layer, the draft pool) holds the pairs [F_j, e(h_{j+1})] for j < m - 1, kept across rounds
as far as the history still agrees and the rest fed in chunks. A round grows the tree by
cumulative draft probability (`tree_model.grow_tree`, EAGLE-2's rule): the root is the pair
[F_{m-1}, e(h_m)], fed after the history's pairs in the catch-up's last chunk (which gives
its next-token distribution and prediction: one head pass fewer a round); a node of token
t whose parent predicted f̂ is the pair [f̂, e(t)]; for each further level one tree extend
of the head over every node so far (`BatchInfo.depth` / `ancestors`) gives each node's
next-token distribution over the draft vocabulary and its prediction. The tree's pairs sit
in the slots past the cached ones and are overwritten by the next round.
"""

from __future__ import annotations

import numpy as np

from kvjax.cache.paged import BatchInfo
from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, ModelConfig
from kvjax.decode.batching import page_table, pages_for
from kvjax.model.layout import store
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.speculative.drafters import common_prefix
from kvjax.speculative.eagle import draft_head, head_config, head_extend
from kvjax.speculative.eagle_file import HeadFile
from kvjax.speculative.eagle_tree_device import HeadDraft, candidates
from kvjax.speculative.tree_host import tree_batch
from kvjax.speculative.tree_model import grow_tree


class EagleTreeDrafter:
    """Trees from an EAGLE-style head (module docstring). `width` is the tree extend's
    shape (>= max_nodes), `chunk` the shape that feeds the history's pairs, `plan` the
    head's arithmetic (kvjax's CPU kernels too: `NumericsPlan.cpu_kernel` / `cpu_attention`)."""

    reads_features = True

    def __init__(self, head: HeadFile, target_params, config: ModelConfig,
                 cache_config: CacheConfig | None = None, top_k: int = 4, width: int = 16,
                 chunk: int = 32, plan: NumericsPlan = FAST, rerank: bool = False):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.head = store(head.params, plan)  # as the plan's steps take them
        self.vocab, self.identity = head.vocab, head.identity
        self.head_w = draft_head(target_params, config, head.vocab)  # [|vocab|, D], once
        self.target_params, self.config, self.plan = target_params, config, plan
        self.pool = KVPool(head_config(config), cache_config or CacheConfig(
            page_size=16, num_pages=1024))
        self.top_k, self.width, self.chunk = top_k, width, chunk
        self.rerank = rerank  # EAGLE-2's final cut (`grow_tree`): width >= 1 + top_k x depth
        self._state: dict[int, tuple[list[int], list[int]]] = {}  # id -> (history, pages)
        self.last_path_probs: list[float] = []  # the last tree's (`tree_policy`)

    def release(self, seq_id: int = 0) -> None:
        _, pages = self._state.pop(seq_id, ([], []))
        self.pool.release(pages)

    def propose_tree(self, history, max_nodes: int, depth: int, seq_id: int = 0,
                     features=None) -> tuple[list[int], list[int]]:
        """(parents, tokens) of a tree of at most `max_nodes` nodes (the root, the history's
        newest token, included) and `depth` levels below it; `features` float32[m, D] are
        the target's at history[:-1]."""
        if candidates(max_nodes, depth, self.top_k, self.rerank) > self.width:
            raise ValueError(f"{candidates(max_nodes, depth, self.top_k, self.rerank)} "
                             f"candidate nodes > the drafter's width {self.width}")
        history = [int(t) for t in history]
        features = np.asarray(features, np.float32)
        m = len(history) - 1
        if m < 1 or features.shape != (m, self.config.d_model):
            raise ValueError(f"a history of {m + 1} tokens needs features [{m}, "
                             f"{self.config.d_model}], got {features.shape}")
        pages, root = self._catch_up(history, features, seq_id, root=True)
        table = page_table([pages], 1, self.pool.cache_config.block_pages)
        inputs = np.zeros((1, self.width, self.config.d_model), np.float32)
        inputs[0, 0] = features[m - 1]
        known = [1]  # nodes whose input is set; a new node's is its parent's prediction
        preds = np.zeros((self.width, self.config.d_model), np.float32)

        def logp_of(parents, tokens):
            if len(tokens) == 1:  # the root's pass was the catch-up's last extend
                best, columns, preds[0] = root
                return best[None], self.vocab[columns[None]]
            for i in range(known[0], len(tokens)):
                inputs[0, i] = preds[parents[i]]
            known[0] = len(tokens)
            batch, fed = tree_batch(table, m - 1, parents, tokens, self.width)
            best, columns, pred = self._run(inputs, fed, batch)
            preds[:] = pred[0]
            return best[0, :len(tokens)], self.vocab[columns[0, :len(tokens)]]

        parents, tokens, self.last_path_probs = grow_tree(history[-1], logp_of, max_nodes,
                                                          depth, self.top_k, self.rerank)
        return parents, tokens

    def device_draft(self, history: np.ndarray, lengths: np.ndarray, features, room: int,
                     depth: int) -> HeadDraft:
        """The head's side of a device tree loop (`eagle_tree_device`) for rows b with
        `lengths[b]` tokens cached, history[b, :lengths[b] + 1] their tokens and
        `features[b]` [lengths[b], D] the target's: each row's head cache caught up (pairs
        but the root's, as `propose_tree` leaves it, sequence id b) in pages with room for
        `room` more pairs. `release(b)` frees them."""
        cc = self.pool.cache_config
        rows = []
        for b, n in enumerate(lengths):
            self.release(b)
            self._state[b] = ([], self.pool.allocate(pages_for(int(n) + room, cc.page_size)))
            rows.append(self._catch_up(history[b, :n + 1].tolist(),
                                       np.asarray(features[b], np.float32), b)[0])
        width, d = depth + 1, self.config.d_model
        return HeadDraft(
            head=self.head, embedding=self.target_params["embed"]["embedding"],
            head_w=self.head_w, vocab=np.asarray(self.vocab, np.int32), cache=None,
            page_table=page_table(rows, len(rows), cc.block_pages),
            cached=np.asarray(lengths, np.int32) - 1,
            feature=np.stack([np.asarray(f[-1], np.float32) for f in features]),
            pending_features=np.zeros((len(rows), width, d), np.float32),
            pending_tokens=np.zeros((len(rows), width), np.int32),
            pending=np.zeros(len(rows), np.int32), plan=self.plan)

    def _run(self, features: np.ndarray, tokens: np.ndarray, batch: BatchInfo):
        out = self.pool.run(lambda c: head_extend(
            self.head, self.target_params, self.config, c, features, tokens, batch,
            self.head_w, self.top_k, plan=self.plan))
        return tuple(np.asarray(x) for x in out)

    def _catch_up(self, history: list[int], features: np.ndarray, seq_id: int,
                  root: bool = False) -> tuple[list[int], tuple | None]:
        """(the pages of `seq_id`'s head cache, now holding the pairs of history[:-1], and
        with `root` the root pair's (best log-probabilities [top_k], columns [top_k],
        prediction [D])): with `root` the root pair [F_{m-1}, e(h_m)] is fed after them in
        the same chunks (its slot is the tree's root's, as the device loop's `catch_up`)."""
        cached, pages = self._state.get(seq_id, ([], []))
        # pair j needs history[:j + 2]: the pairs of a shared prefix of n tokens still hold
        keep = max(common_prefix(cached, history) - 1, 0)
        want = len(history) - 2 + root
        if root:  # the root's slot is scratch: fed every round (a shorter history too)
            keep = min(keep, want - 1)
        cc = self.pool.cache_config
        need = pages_for(len(history) - 2 + self.width, cc.page_size) - len(pages)
        if need > 0:
            pages += self.pool.allocate(need)
        table = page_table([pages], 1, cc.block_pages)
        out = None
        for start in range(keep, want, self.chunk):
            count = min(self.chunk, want - start)
            feats = np.zeros((1, self.chunk, self.config.d_model), np.float32)
            feats[0, :count] = features[start:start + count]
            fed = np.zeros((1, self.chunk), np.int32)
            fed[0, :count] = history[start + 1:start + 1 + count]
            best, columns, pred = self._run(feats, fed, BatchInfo(
                page_table=table, lengths=np.asarray([start], np.int32),
                num_new=np.asarray([count], np.int32)))
            out = best[0, count - 1], columns[0, count - 1], pred[0, count - 1]
        self._state[seq_id] = (history[:-1], pages)
        return pages, out if root else None
