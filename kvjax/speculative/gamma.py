"""Adaptive γ: one policy for the engine's device loop and the host Drafter path.

Each call (or round) picks the γ ≤ γ_max with the best expected tokens per unit of target
time, `expected_tokens(γ) / (γc + 1 + sγ)`: c is the draft's step cost over the target's,
s the verify slope (a verify of γ + 1 tokens costs 1 + sγ target steps). Expected tokens
come from running, decayed acceptance by draft position where there is evidence (drafters
are not i.i.d.: an n-gram continuation's later tokens fail more often), else from the
running α. The engine's device loop may offer a subset of the γ values (`choices`: one
verify width compiled each, `kvjax.speculative.loop.verify_widths`). Host code: plain
Python + numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DECAY = 0.8  # weight of the older calls in the running estimates
MIN_EVIDENCE = 4.0  # decayed drafts at a position before its own acceptance rate is trusted


def best_gamma(tokens: Sequence[float], c: float, verify_slope: float = 0.0,
               choices: Sequence[int] | None = None) -> int:
    """The γ (1-based index into `tokens`, expected tokens per round for γ = 1, 2, ...;
    among `choices` when given) with the best tokens per unit of target time; the smallest
    on ties."""
    return max(choices or range(1, len(tokens) + 1),
               key=lambda g: (tokens[g - 1] / (g * c + 1 + verify_slope * g), -g))


def iid_tokens(alpha: float, gamma_max: int) -> list[float]:
    """Expected tokens per round for γ = 1 .. gamma_max when every draft is accepted with
    probability α independently: 1 + α + ... + α^γ."""
    out, total, prefix = [], 1.0, 1.0
    for _ in range(gamma_max):
        prefix *= alpha
        total += prefix
        out.append(total)
    return out


def choose_gamma(alpha: float, c: float, gamma_max: int, verify_slope: float = 0.0) -> int:
    """The best γ in [1, gamma_max] at a fixed i.i.d. acceptance α (the smallest on ties):
    what `GammaPolicy.choose` returns when its running α is α and no position has enough
    evidence of its own."""
    return best_gamma(iid_tokens(alpha, gamma_max), c, verify_slope)


class GammaPolicy:
    """Running acceptance estimates and the γ they recommend (module docstring)."""

    def __init__(self, gamma_max: int, choices: Sequence[int] | None = None):
        self.gamma_max = gamma_max
        self.choices = None if choices is None else sorted(set(choices))  # None: 1 .. max
        if self.choices is not None and not (
                self.choices[0] >= 1 and self.choices[-1] == gamma_max):
            raise ValueError(f"γ choices must be in [1, {gamma_max}] and include it, got "
                             f"{choices}")
        self.alpha = [0.0, 0.0]  # decayed (sum, count) of E[min(p, q)]
        self.drafted = np.zeros(gamma_max)  # decayed drafts at each position
        self.accepted = np.zeros(gamma_max)  # decayed accepted prefixes reaching it

    @property
    def has_evidence(self) -> bool:
        return self.alpha[1] > 0

    def observe(self, gamma: int, alpha_sum: float, alpha_count: float,
                drafted_by_position: Sequence[float],
                accepted_by_position: Sequence[float]) -> None:
        """Folds in one call (or round) drafted with `gamma`. Only positions drafted in it
        age: a short γ must not erase what longer drafts taught about the positions it no
        longer reaches."""
        self.alpha = [DECAY * self.alpha[0] + alpha_sum, DECAY * self.alpha[1] + alpha_count]
        drafted = np.asarray(drafted_by_position, np.float64)[:gamma]
        accepted = np.asarray(accepted_by_position, np.float64)[:gamma]
        self.drafted[:gamma] = DECAY * self.drafted[:gamma] + drafted
        self.accepted[:gamma] = DECAY * self.accepted[:gamma] + accepted

    def expected_tokens(self) -> list[float]:
        """Expected tokens per round for γ = 1 .. gamma_max: 1 + Σ_i P(the first i drafts
        are all accepted). P is the running acceptance by position where there is evidence;
        past the last such position it is extended with the last observed conditional
        acceptance P(i | i − 1), or with the running α when there is no evidence at all."""
        alpha = self.alpha[0] / self.alpha[1] if self.alpha[1] else 0.5
        prefix, step, total, out = 1.0, alpha, 1.0, []
        for i in range(self.gamma_max):
            if self.drafted[i] >= MIN_EVIDENCE:
                observed = self.accepted[i] / self.drafted[i]
                step = min(observed / prefix, 1.0) if prefix > 0 else 0.0
                prefix = observed
            else:
                prefix *= step
            total += prefix
            out.append(total)
        return out

    def choose(self, c: float | None, verify_slope: float | None = 0.0) -> int:
        """The next γ: gamma_max until something was observed, then the best one."""
        if not self.has_evidence:
            return self.gamma_max
        return best_gamma(self.expected_tokens(), c or 0.0, verify_slope or 0.0,
                          self.choices)
