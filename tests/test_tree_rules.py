"""Exact sampling over a token tree (`kvjax.speculative.tree.sampled_path`), by statistics.

A toy target over 8 tokens whose next-token distribution depends on the previous token
(three rows of P) generates two tokens after token 0, each round verifying a fixed tree
from the newest token: deterministic children (distinct tokens) or children drawn
independently from a draft distribution Q. Over 40,000 two-token runs the joint of the two
tokens is compared with the target's, P(x1 | 0) P(x2 | x1): a correct rule's total-variation
distance is about 0.016 (64 cells; measured 0.016 deterministic, 0.013 sampled); the
threshold 0.04 is ~5 standard deviations above it.
Rules that skip the residual (test every child against the target's distribution, or draw
the last token from it) land at 0.24 and 0.30 and fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.speculative.tree import sampled_path

V = 8
P = np.array([[0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05],
              [0.05, 0.05, 0.40, 0.20, 0.10, 0.10, 0.05, 0.05],
              [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.20, 0.20]])
Q = np.array([0.05, 0.40, 0.05, 0.30, 0.05, 0.05, 0.05, 0.05])


def target(prev: int) -> np.ndarray:
    return P[prev % 3]


def _tree(last: int, rng, sampled: bool):
    """(parents, tokens, q) from `last`: two children, the first of which has one child and
    the second two (deterministic: tokens 1, 3 / 2 / 2, 6; sampled: each drawn from Q)."""
    parents = [-1, 0, 0, 1, 2, 2]
    if sampled:
        tokens = [last, *rng.choice(V, size=5, p=Q).tolist()]
        return parents, tokens, [None] + [Q] * 5
    return parents, [last, 1, 3, 2, 2, 6], None


def _wrong_no_residual(parents, tokens, p, q, rng):
    """Tests every child against p itself and draws the last token from p."""
    path = [0]
    while True:
        for c in (i for i in range(1, len(parents)) if parents[i] == path[-1]):
            q_c = np.eye(V)[tokens[c]] if q is None else q[c]
            if rng.random() * q_c[tokens[c]] < p[path[-1]][tokens[c]]:
                path.append(c)
                break
        else:
            return path, int(rng.choice(V, p=p[path[-1]]))


def _joint(rule, sampled: bool, n: int = 40_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        out = []
        while len(out) < 2:
            last = out[-1] if out else 0
            parents, tokens, q = _tree(last, rng, sampled)
            p = np.stack([target(t) for t in tokens])  # node i's next-token distribution
            path, nxt = rule(parents, tokens, p, q, rng)
            out += [tokens[c] for c in path[1:]] + [nxt]
        counts[out[0], out[1]] += 1
    return counts / n


def _tv_to_target(joint: np.ndarray) -> float:
    want = target(0)[:, None] * np.stack([target(x) for x in range(V)])
    return 0.5 * float(np.abs(joint - want).sum())


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_sampling_follows_the_target_distribution(sampled):
    assert _tv_to_target(_joint(sampled_path, sampled)) < 0.04


@pytest.mark.parametrize("sampled", [False, True])
def test_a_rule_without_the_residual_fails_the_same_test(sampled):
    assert _tv_to_target(_joint(_wrong_no_residual, sampled, n=10_000)) > 0.08
