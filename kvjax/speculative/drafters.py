"""Drafters propose the next γ tokens of each sequence; the target verifies them.

A drafter is anything with `propose(histories, gamma) -> list of (tokens, q)` (the
`Drafter` protocol): `tokens` are up to γ proposed ids, `q` is float32[len(tokens), V] —
the distributions they were drawn from — or None for a deterministic proposal (treated as
one-hot by the exact sampling rule). `seq_ids` name the sequences across calls, for
drafters that keep per-sequence state. The n-gram drafter is plain Python + numpy; the
model drafter drives its own paged cache through the jitted steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from kvjax.cache.pool import KVPool
from kvjax.config import CacheConfig, SamplingConfig, SpecConfig
from kvjax.decode import steps
from kvjax.decode.batching import page_table, pages_for
from kvjax.decode.prefill import prefill
from kvjax.decode.sampling import DRAFT_TAG, jitted_probabilities
from kvjax.decode.state import decode_state
from kvjax.model.plan import FAST, NumericsPlan
from kvjax.speculative.tree import ngram_continuations


def draft_key(seed: int, seq_id: int) -> jax.Array:
    """uint32[2]: the draft's sampling key of sequence `seq_id`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), seq_id), DRAFT_TAG)


class Drafter(Protocol):
    def propose(self, histories: Sequence[Sequence[int]], gamma: int,
                seq_ids: Sequence[int] | None = None
                ) -> list[tuple[list[int], np.ndarray | None]]: ...


class NGramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the history's last n-gram
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose_one(self, history: Sequence[int], gamma: int) -> list[int]:
        found = ngram_continuations(history, gamma, self.max_ngram, self.min_ngram, 1)
        return found[0] if found else []

    def propose(self, histories, gamma, seq_ids=None):
        return [(self.propose_one(h, gamma), None) for h in histories]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def catch_up(pool: KVPool, params, config, cached: list[int], pages: list[int],
             history: list[int], room: int, plan: NumericsPlan = FAST) -> None:
    """Brings a draft cache that holds `cached` in `pages` to history[:-1]: keeps the
    longest prefix still on the history and prefills the rest, `pages` grown (in place)
    to hold the history and `room` more tokens."""
    cc = pool.cache_config
    keep = min(common_prefix(cached, history), len(history) - 1)
    need = pages_for(len(history) + room, cc.page_size) - len(pages)
    if need > 0:
        pages += pool.allocate(need)
    if keep < len(history) - 1:
        pool.run(lambda c: prefill(params, config, c, cc, history[:-1], pages, start=keep,
                                   plan=plan))


class ModelDrafter:
    """A small kvjax Transformer (same vocabulary as the target) drafting with its own paged
    cache. Per sequence the cache holds the history minus its newest token; after a
    verification it keeps the longest prefix still on the history (its own rollback) and
    feeds the rest before drafting again. With temperature 0 it drafts greedily
    (deterministic proposals); otherwise it samples and returns its distributions q, with a
    key of its own per sequence, `fold_in(fold_in(PRNGKey(seed), seq_id), DRAFT_TAG)` (the
    engine's draft key for sequence `seq_id`): identical prompts get independent drafts.
    """

    def __init__(self, params, config, cache_config, sampling=None):
        self.params, self.config = params, config
        self.pool = KVPool(config, cache_config)
        self.sampling = sampling
        self._state: dict[int, tuple[list[int], list[int]]] = {}  # id -> (cached, pages)
        self._keys: dict[int, np.ndarray] = {}  # id -> uint32[1, 2]

    def release(self, seq_id: int) -> None:
        _, pages = self._state.pop(seq_id, ([], []))
        self.pool.release(pages)

    def propose(self, histories, gamma, seq_ids=None):
        seq_ids = range(len(histories)) if seq_ids is None else seq_ids
        return [self._propose_one(list(h), gamma, i)
                for h, i in zip(histories, seq_ids, strict=True)]

    def _propose_one(self, history: list[int], gamma: int, seq_id: int):
        cc = self.pool.cache_config
        cached, pages = self._state.get(seq_id, ([], []))
        catch_up(self.pool, self.params, self.config, cached, pages, history, gamma)
        table = page_table([pages], 1, cc.block_pages)
        length = len(history) - 1
        sampling = self.sampling
        temp = 0.0 if sampling is None else sampling.temperature
        if seq_id not in self._keys:
            seed = 0 if sampling is None else sampling.seed
            self._keys[seq_id] = np.asarray(draft_key(seed, seq_id))[None]
        keys = self._keys[seq_id]
        state = decode_state(table, [length], [history[-1]], [gamma], keys, [sampling])
        res = steps.decode(self.pool, self.params, self.config, state, gamma,
                           return_logits=temp > 0)
        draft = np.asarray(res.tokens)[0, :gamma].tolist()
        self._state[seq_id] = (history + draft[:-1], pages)
        if temp == 0:
            return draft, None
        return draft, np.asarray(jitted_probabilities(res.logits, *state.knobs)[0])


def make_drafter(spec: SpecConfig, draft: tuple | None = None,
                 cache: CacheConfig | None = None,
                 sampling: SamplingConfig | None = None) -> Drafter:
    """The drafter a SpecConfig names; `draft=(params, config)` for the model drafter."""
    if spec.drafter == "ngram":
        return NGramDrafter(max_ngram=spec.ngram_max)
    if draft is None:
        raise ValueError("the model drafter needs draft=(draft_params, draft_config)")
    return ModelDrafter(draft[0], draft[1], cache or CacheConfig(), sampling)
