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

The engine's trees come back without scores: `WidthPolicy` picks each call's width from
what the calls before it accepted. A tree built with a budget of w nodes is the first w
nodes of the tree built with more: an n-gram tree's (`ngram_tree_device`: nodes are
appended in one order and a chain past the budget only stops) and an EAGLE head's grown
level by level (`eagle_tree_device.grow`: each level adds the best offers in order, and a
budget only cuts the last level short; not after EAGLE-2's rerank, which picks among every
level's offers; exactly under invariant numerics, where a node's bits do not depend on the
tree's width: under fast numerics a near-tie may differ, which moves only these counts).
An accepted path's node indices grow with its depth (greedy or sampled), so a verify of N
nodes also tells what every cut to w < N nodes would have accepted: the path's drafts with
index below w (`tree_loop` counts them, `accepted_by_width`). The cost of a width is its round's:
the verify's, v(w), and for an EAGLE head also its drafting, h(w), timed with the verify
(`kvjax.speculative.cost.round_costs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DECAY = 0.9  # weight of the older calls in the calibration


def interpolated(measured: Mapping[int, float], n: int) -> float:
    """v(n) from costs measured at some node counts: piecewise linear between them, and
    past the last along the last segment's slope (flat with one point), never below the
    cheapest measured cost (a falling last segment would reach 0)."""
    points = sorted(measured.items())
    if not points:
        raise ValueError("no measured verify costs")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if n <= xs[-1] or len(xs) == 1:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(max(ys[-1] + slope * (n - xs[-1]), min(ys)))


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


WIDTH_DECAY = 0.8  # weight of the older calls in the width policy's estimates


def tree_widths(depth: int, tree_nodes: int) -> list[int]:
    """The widths an adaptive tree call chooses from: 2, 4, 8, ... below `tree_nodes`,
    depth + 1 (an n-gram tree's chain of the full depth) and `tree_nodes`; one compiled
    verify each."""
    powers = [1 << i for i in range(1, tree_nodes.bit_length())]
    return sorted({w for w in [*powers, depth + 1, tree_nodes] if 2 <= w <= tree_nodes})


class WidthPolicy:
    """Each call's tree width: the one with the most expected tokens per verify cost,
    tokens(w) / v(w), from running, decayed counts of what calls accepted at each width
    (module docstring). A call of width W informs every width up to W; a wider width keeps
    the gain over the next narrower one that calls wide enough last measured, applied to
    the fresh estimate below it. So that a gain that grows later is seen, every `explore`-th
    call verifies the widest width (0: never): it refreshes every width's gain at once."""

    def __init__(self, widths: Sequence[int], explore: int = 8):
        self.widths = sorted(widths)
        self.explore, self._calls = explore, 0
        n = len(self.widths)
        self.verifications = np.zeros(n)  # decayed verifications of calls of width >= w
        self.tokens = np.zeros(n)  # the tokens they emit cut to w: 1 + accepted each
        self.narrower = np.zeros(n)  # the same verifications' tokens cut to the width below

    def observe(self, width: int, verifications: int, accepted_by_width: Sequence[int]) -> None:
        """Folds in one call of `width` nodes: its verifications and accepted_by_width[w - 1],
        the drafts they would have accepted with every tree cut to w nodes (w = 1 .. width).
        Only the widths the call could inform age."""
        if verifications <= 0:
            return
        for i, w in enumerate(self.widths):
            if w > width:
                break
            self.verifications[i] = WIDTH_DECAY * self.verifications[i] + verifications
            self.tokens[i] = WIDTH_DECAY * self.tokens[i] + verifications + accepted_by_width[w - 1]
            if i:
                below = verifications + accepted_by_width[self.widths[i - 1] - 1]
                self.narrower[i] = WIDTH_DECAY * self.narrower[i] + below

    def expected_tokens(self) -> list[float]:
        """Expected tokens per verification at each width (one-based, `widths` order): the
        narrowest's running mean, then each wider one's measured gain over the one below."""
        if self.verifications[0] <= 0:
            raise ValueError("no call observed yet")
        out = [self.tokens[0] / self.verifications[0]]
        for i in range(1, len(self.widths)):  # a gain never measured counts as none
            out.append(out[-1] * (self.tokens[i] / self.narrower[i] if self.narrower[i] else 1))
        return [float(x) for x in out]

    def choose(self, verify_cost: Mapping[int, float]) -> int:
        """The next call's width: the widest until a call was observed, then the one with
        the most expected tokens per v(w) (interpolated from `verify_cost`; the narrowest on
        ties), or every `explore`-th time the widest."""
        if self.verifications[-1] <= 0:
            return self.widths[-1]
        tokens = self.expected_tokens()
        cost = [interpolated(verify_cost, w) for w in self.widths]
        best = max(range(len(self.widths)), key=lambda i: (tokens[i] / cost[i], -i))
        self._calls += 1
        if self.explore and self._calls % self.explore == 0:
            return self.widths[-1]
        return self.widths[best]
