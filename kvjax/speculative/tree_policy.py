"""How many tree nodes to verify: the γ policy for trees, from measured costs. Host code.

A verify of N nodes costs v(N) decode steps of the target (`kvjax bench tree` measures it:
not linear, and on this CPU a tree's per-node tiles make it dearer than a chain of N), and
drafting the round's tree of d levels cost d·c already. A tree drafter that scores its
nodes (the path's cumulative draft probability, EAGLE-2's rule) predicts its own
acceptance: the expected
tokens a verify emits from the tree's first N nodes is 1 + Σ p_i over its N - 1 drafted
nodes, where p_i is node i's path probability (a path is accepted only if all of it is).
The policy cuts each drafted tree to the N among the verify widths it can run that gives
the most expected tokens per unit of the round's time, (1 + k Σ p_i) / (v(N) + d·c), with k a
running calibration of predicted to observed acceptance (draft probabilities are
over-confident where the head is weak). Nodes come in the drafter's order, parents before
children, so every prefix is a tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DECAY = 0.9  # weight of the older calls in the calibration


def interpolated(measured: Mapping[int, float], n: int) -> float:
    """v(n) from costs measured at some node counts: piecewise linear between them, and
    past the last along the last segment's slope (flat with one point)."""
    points = sorted(measured.items())
    if not points:
        raise ValueError("no measured verify costs")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if n <= xs[-1] or len(xs) == 1:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (n - xs[-1]))


def expected_tokens(path_probs: Sequence[float], k: float = 1.0) -> list[float]:
    """Expected tokens per verify of the tree's first N = 1, 2, ... nodes: 1 + k times the
    sum of the drafted nodes' path probabilities (the root, node 0, has none)."""
    return [1.0 + k * float(s) for s in np.cumsum([0.0, *path_probs[1:]])]


def best_size(tokens: Sequence[float], cost: Sequence[float], sizes: Sequence[int]) -> int:
    """The N in `sizes` (1-based, at most len(tokens)) with the most tokens[N-1] per
    cost[N-1]; the smallest on ties."""
    usable = [n for n in sizes if n <= len(tokens)] or [1]
    return max(usable, key=lambda n: (tokens[n - 1] / cost[n - 1], -n))


class TreeSizePolicy:
    """Cuts scored trees to the best verify width (module docstring). `verify_cost`: node
    count -> v(N) in target decode steps, measured; `draft_cost`: a draft level's cost in
    the same unit; `sizes`: the widths the verify is compiled for."""

    def __init__(self, verify_cost: Mapping[int, float], draft_cost: float = 0.0,
                 sizes: Sequence[int] = (1, 2, 4, 8, 16)):
        self.verify_cost, self.draft_cost = dict(verify_cost), draft_cost
        self.sizes = sorted(sizes)
        self._calibration = [0.0, 0.0]  # decayed (observed accepted, predicted accepted)

    @property
    def k(self) -> float:
        """Observed over predicted acceptance (1 until something was observed)."""
        seen, predicted = self._calibration
        return seen / predicted if predicted > 0 else 1.0

    def choose(self, parents: Sequence[int], path_probs: Sequence[float]) -> int:
        """How many of the tree's nodes to verify."""
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        drafting = max(depth) * self.draft_cost  # spent whatever is verified
        cost = [interpolated(self.verify_cost, n) + drafting
                for n in range(1, len(parents) + 1)]
        return best_size(expected_tokens(path_probs, self.k), cost, self.sizes)

    def observe(self, path_probs: Sequence[float], accepted: int) -> None:
        """Folds in one verify: the verified nodes' path probabilities and how many drafts
        it accepted."""
        predicted = float(np.sum(path_probs[1:]))
        self._calibration = [DECAY * self._calibration[0] + accepted,
                             DECAY * self._calibration[1] + predicted]
