"""An EAGLE-style head drafting in the engine: its pages, its prefill, its state per sample.

The head's cache is the engine's draft pool (`KVCacheManager.draft`, pages of
`eagle.head_config(target)`). Slot j of a sample's head pages holds the pair
[F_j, e(h_{j+1})] (F_j the target's feature at token h_j), which depends on the history up
to h_{j+1}: one token past the target's slot j. So the head's pages enter its trie keyed by
the history from h_1 on, with h_0 in the first block's salt (`PagePool.lead`,
`kvjax.cache.admission.pool_keys`): a page is reused only where every token it depends on
is the same.

Prefill: a target prefill call of tokens [s, s + n) of an L-token context returns their
features, which complete the pairs [s, min(s + n, L - 1)); the head extends by them in the
same call shape. A sample's head pairs therefore always reach where its target prefill
starts (an admission reuses as many pages in both pools: the target's reuse is cut to the
head's), and after the prefill every pair but the root's [F_{L-1}, e(first token)] is
cached; the sample keeps F_{L-1} (`HeadState`).

Decode: `tree_loop` with the head (`eagle_tree_device`); each sample's root feature and
pending pairs (those its last verify accepted, not yet in the head's cache) go in by slot
and come back with its cached pair count (`Seq.draft_length`). Host code: plain Python +
numpy, and one jitted head extend.

Legend: B rows, T tokens per row, D model width, W pending width (depth + 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np

from kvjax.cache.identity import model_fingerprint, plan_identity
from kvjax.cache.paged import BatchInfo, model_positions
from kvjax.config import ModelConfig
from kvjax.decode.aot import program
from kvjax.decode.batching import page_table
from kvjax.decode.prefill import PrefillRow
from kvjax.io.hf import CheckpointError
from kvjax.model.layout import store, unstored
from kvjax.model.plan import NumericsPlan
from kvjax.speculative.eagle import EagleHead, draft_head, embed, head_config
from kvjax.speculative.eagle_file import HeadFile
from kvjax.speculative.eagle_tree_device import HeadDraft

LEAD = 1  # a head slot's pair depends on one token past the target's slot (`PagePool.lead`)


@dataclasses.dataclass
class HeadState:
    """A sample's head side between decode calls."""

    feature: np.ndarray  # float32[D]: F_{L-1}, the root pair's feature
    pending_features: np.ndarray  # float32[W, D]: pairs accepted, not yet cached
    pending_tokens: np.ndarray  # int32[W]
    pending: int = 0

    @classmethod
    def start(cls, feature, width: int) -> HeadState:
        """After a prefill: the root feature, nothing pending."""
        feature = np.asarray(feature, np.float32)
        return cls(feature, np.zeros((width, feature.shape[-1]), np.float32),
                   np.zeros(width, np.int32))


@program("head_prefill", {(): "cache"}, static_argnames=("config", "plan"),
         donate_argnames=("cache",))
def head_prefill(head: dict, embedding: jax.Array, config: ModelConfig, cache, features,
                 tokens, batch: BatchInfo, plan: NumericsPlan):
    """Appends the pairs [features, e(tokens)] ([B, T, D], int32[B, T]) to the head's
    cache as `batch` says (`config`: the target's); returns the cache. Donates `cache`."""
    x = embed({"embed": {"embedding": embedding}}, config, tokens)
    _, cache = EagleHead(head_config(config), plan).apply(
        {"params": unstored(head, plan)}, features, x, model_positions(batch, tokens.shape[1]),
        cache, batch)
    return cache


class EagleSide:
    """The head's weights and the host work of an engine that drafts with it."""

    def __init__(self, head: HeadFile, config: ModelConfig, plan: NumericsPlan,
                 target_plan: NumericsPlan, depth: int):
        self.file, self.config, self.plan, self.width = head, config, plan, depth + 1
        # through the host: the head's file restores committed arrays, which would commit
        # every result they meet (the caches) and so change the programs jit picks after a
        # warm-up (whose placeholders are not committed)
        self.head = jax.device_put(jax.tree.map(np.asarray, store(head.params, plan)))
        self.vocab = np.asarray(head.vocab, np.int32)
        # the pairs' K/V depend on the head, its arithmetic and the target's features (its
        # weights are in the head's identity, its arithmetic is not)
        text = json.dumps(plan_identity(target_plan), sort_keys=True)
        self.fingerprint = hashlib.sha256((head.identity + text + model_fingerprint(
            head_config(config), head.params, plan)).encode()).hexdigest()[:32]
        self.embedding = self.head_w = None  # the target's, from `bind`

    def bind(self, target_params) -> None:
        """Reads the target's embedding and output head rows (canonical `target_params`);
        refuses weights other than those the head was trained on."""
        got = model_fingerprint(self.config, target_params)
        if got != self.file.target:
            raise CheckpointError(f"the EAGLE head was trained on another target (fingerprint "
                                  f"{self.file.target}, these weights {got}): train a head "
                                  f"for them")
        self.embedding = jax.device_put(target_params["embed"]["embedding"])
        self.head_w = jax.device_put(draft_head(target_params, self.config, self.vocab))

    def prefill(self, kv, rows: list[PrefillRow], heads: list[PrefillRow], features,
                starts: list[int], min_pages: int) -> None:
        """After a target prefill call that wrote tokens [starts[i], rows[i].start) of each
        row with `features` [B, T, D] (the call's): the pairs they complete into the head's
        pages (`heads[i]`, whose start is starts[i]); a row whose context is done keeps its
        last feature in `heads[i].feature`."""
        b, t = features.shape[:2]
        tokens = np.zeros((b, t), np.int32)
        lengths, count = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, (row, head, s) in enumerate(zip(rows, heads, starts, strict=True)):
            if head.start != s:
                raise AssertionError(f"head pairs at {head.start}, target prefill at {s}")
            n = min(row.start, len(row.tokens) - 1) - s  # pairs [s, s + n)
            tokens[i, :n] = row.tokens[s + 1: s + 1 + n]
            lengths[i], count[i] = s, n
            head.start = s + n
        table = page_table([h.pages for h in heads], b, kv.draft.cache_config.block_pages,
                           min_pages)
        if count.any():
            kv.run(lambda cache: (None, head_prefill(
                self.head, self.embedding, self.config, cache, features, tokens,
                BatchInfo(page_table=table, lengths=lengths, num_new=count), self.plan)),
                draft=True)
        done = [i for i, row in enumerate(rows) if row.start == len(row.tokens)]
        if done:  # read on the host: an index on device would compile per call shape
            last = np.asarray(features)[np.asarray(done), np.asarray(
                [rows[i].start - starts[i] - 1 for i in done])]  # [done, D]
            for i, feature in zip(done, last, strict=True):
                heads[i].feature = feature

    def draft(self, live, slots: int, block_pages: int, min_pages: int) -> HeadDraft:
        """The head's side of a tree call over `slots` rows (`live`'s samples by slot)."""
        rows = [[] for _ in range(slots)]
        d = self.config.d_model
        cached, pending = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        feature = np.zeros((slots, d), np.float32)
        feats = np.zeros((slots, self.width, d), np.float32)
        tokens = np.zeros((slots, self.width), np.int32)
        for seq in live:
            i, h = seq.slot, seq.head
            rows[i], cached[i], pending[i] = seq.draft_pages, seq.draft_length, h.pending
            feature[i], feats[i], tokens[i] = h.feature, h.pending_features, h.pending_tokens
        return HeadDraft(
            head=self.head, embedding=self.embedding, head_w=self.head_w, vocab=self.vocab,
            cache=None, page_table=page_table(rows, slots, block_pages, min_pages),
            cached=cached, feature=feature, pending_features=feats, pending_tokens=tokens,
            pending=pending, plan=self.plan)

    @staticmethod
    def absorb(live, out: HeadDraft) -> None:
        """Each sample's head side after a tree call (`out`: the call's, as numpy)."""
        for seq in live:
            i = seq.slot
            seq.draft_length = int(out.cached[i])
            seq.head = HeadState(out.feature[i].copy(), out.pending_features[i].copy(),
                                 out.pending_tokens[i].copy(), int(out.pending[i]))

