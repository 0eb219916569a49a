"""Drafters propose the next γ tokens of each sequence; the target verifies them.

A drafter is anything with `propose(histories, gamma) -> list of (tokens, q)` (the
`Drafter` protocol): `tokens` are up to γ proposed ids, `q` is float32[len(tokens), V] —
the distributions they were drawn from — or None for a deterministic proposal (treated as
one-hot by the exact sampling rule). Host code: plain Python + numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Drafter(Protocol):
    def propose(self, histories: Sequence[Sequence[int]],
                gamma: int) -> list[tuple[list[int], np.ndarray | None]]: ...


class NGramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the history's last n-gram
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose_one(self, history: Sequence[int], gamma: int) -> list[int]:
        h = np.asarray(history)
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            # Candidate starts of an earlier occurrence, most recent first.
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            for start in hits[::-1]:
                follow = h[start + n: start + n + gamma]
                if len(follow):
                    return follow.tolist()
        return []

    def propose(self, histories, gamma):
        return [(self.propose_one(h, gamma), None) for h in histories]
