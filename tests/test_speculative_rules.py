"""Speculative acceptance rules: greedy on hand-built cases, and exact sampling by statistics.

The sampling tests draw N independent speculative steps on an 8-token vocabulary with fixed
target (p) and draft (q) distributions that differ, and measure the total-variation distance
between the emitted tokens and p: for the first token, for a token after an accepted one
(which is a residual draw when that position is rejected), and for the bonus token. With
N = 40,000 the distance of a correct rule is about 0.007; the threshold 0.02 sits ~5
standard deviations above it, so a correct rule fails with probability < 1e-5 (and the
seeds are fixed, so the test is deterministic). A deliberately wrong rule (resampling from
p instead of the residual after a rejection) lands at ~0.1 and fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decode.sampling import sequence_keys
from kvjax.speculative.gamma import GammaPolicy
from kvjax.speculative.rules import greedy_accept, predicted_speedup, sampling_accept

V, G = 8, 2
P = np.array([[0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05],
              [0.05, 0.05, 0.40, 0.20, 0.10, 0.10, 0.05, 0.05],
              [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.20, 0.20]], np.float32)
Q = np.array([[0.05, 0.40, 0.05, 0.30, 0.05, 0.05, 0.05, 0.05],
              [0.20, 0.05, 0.20, 0.05, 0.20, 0.05, 0.20, 0.05]], np.float32)


def _tv(samples: np.ndarray, probs: np.ndarray) -> float:
    freq = np.bincount(samples, minlength=V) / max(len(samples), 1)
    return 0.5 * float(np.abs(freq - probs).sum())


def _draw_drafts(n: int, q: np.ndarray, seed: int) -> np.ndarray:
    keys = jax.random.split(jax.random.PRNGKey(seed), n * G).reshape(n, G, 2)
    logits = jnp.log(jnp.asarray(q))
    return np.asarray(jax.vmap(jax.vmap(jax.random.categorical))(
        keys, jnp.broadcast_to(logits, (n, G, V))))


def _speculate(n: int, seed: int, q: np.ndarray = Q, rule=sampling_accept):
    draft = _draw_drafts(n, q, seed)
    accepted, nxt = jax.jit(rule)(
        jnp.asarray(draft, jnp.int32), jnp.broadcast_to(jnp.asarray(q), (n, G, V)),
        jnp.broadcast_to(jnp.asarray(P), (n, G + 1, V)), jnp.full((n,), G, jnp.int32),
        sequence_keys(seed + 1, n), jnp.zeros((n,), jnp.int32))
    return draft, np.asarray(accepted), np.asarray(nxt)


def _emitted(draft, accepted, nxt):
    """Per sequence the emitted tokens: the accepted drafts, then the next token."""
    first = np.where(accepted >= 1, draft[:, 0], nxt)
    after_first = accepted >= 1
    second = np.where(accepted >= 2, draft[:, 1], nxt)[after_first]
    bonus = nxt[accepted == G]
    return first, second, bonus


def _wrong_rule(draft, q, p, num_draft, keys, positions):
    """Accepts like the exact rule, but after a rejection draws from p, not the residual."""
    accepted, _ = sampling_accept(draft, q, p, num_draft, keys, positions)
    rows = jnp.arange(draft.shape[0])
    redraw = jax.vmap(jax.random.categorical)(jax.vmap(lambda k: jax.random.fold_in(k, 7))(
        keys), jnp.log(p[rows, accepted]))
    return accepted, redraw.astype(jnp.int32)


def test_exact_sampling_matches_the_target_distribution():
    first, second, bonus = _emitted(*_speculate(40_000, seed=0))
    assert _tv(first, P[0]) < 0.02
    assert _tv(second, P[1]) < 0.02
    assert len(bonus) > 5_000 and _tv(bonus, P[2]) < 0.03
    # The distance shrinks with the sample count as sampling noise must.
    small_first, _, _ = _emitted(*_speculate(1_000, seed=5))
    assert _tv(first, P[0]) < _tv(small_first, P[0])


def test_a_wrong_rule_fails_the_same_test():
    first, _, _ = _emitted(*_speculate(40_000, seed=0, rule=_wrong_rule))
    assert _tv(first, P[0]) > 0.05


def test_deterministic_proposal_rule_is_exact():
    """The n-gram drafter proposes fixed tokens: q is one-hot."""
    n = 40_000
    draft = np.tile(np.array([[1, 3]], np.int32), (n, 1))
    q = np.zeros((n, G, V), np.float32)
    q[:, 0, 1] = q[:, 1, 3] = 1.0
    accepted, nxt = jax.jit(sampling_accept)(
        draft, q, np.broadcast_to(P, (n, G + 1, V)), np.full(n, G, np.int32),
        sequence_keys(9, n), np.zeros(n, np.int32))
    first, second, _ = _emitted(draft, np.asarray(accepted), np.asarray(nxt))
    assert _tv(first, P[0]) < 0.02
    assert _tv(second, P[1]) < 0.03


def test_greedy_rule_on_hand_built_cases():
    logits = np.full((3, G + 1, V), -1.0, np.float32)
    best = np.array([[2, 5, 7], [2, 5, 7], [2, 5, 7]])
    for b in range(3):
        for i in range(G + 1):
            logits[b, i, best[b, i]] = 3.0
    draft = np.array([[2, 5], [4, 5], [2, 6]], np.int32)  # right, wrong first, wrong second
    accepted, nxt = greedy_accept(draft, logits, np.array([2, 2, 2], np.int32))
    np.testing.assert_array_equal(accepted, [2, 0, 1])
    np.testing.assert_array_equal(nxt, [7, 2, 5])
    accepted, nxt = greedy_accept(draft, logits, np.array([1, 2, 0], np.int32))
    np.testing.assert_array_equal(accepted, [1, 0, 0])
    np.testing.assert_array_equal(nxt, [5, 2, 2])


@pytest.mark.parametrize(("alpha", "gamma", "c", "expected"), [
    (0.0, 4, 0.1, 1 / 1.4), (1.0, 4, 0.1, 5 / 1.4), (0.8, 4, 0.1, (1 - 0.8**5) / (0.2 * 1.4)),
    (0.5, 1, 0.0, 1.5)])
def test_predicted_speedup(alpha, gamma, c, expected):
    assert predicted_speedup(alpha, gamma, c) == pytest.approx(expected, rel=1e-12)


def test_adaptive_gamma_policy_on_hand_computed_cases():
    """Acceptance evidence decays by 0.8 per call at the positions that call drafted only;
    past the positions with evidence (>= 4 decayed drafts) P(first i accepted) is extended
    with the last observed conditional acceptance, and with the running α before any
    positional evidence."""
    fresh = GammaPolicy(3)
    assert fresh.choose(0.1) == 3  # nothing observed: gamma_max
    fresh.observe(1, 3.0, 4.0, [2.0], [1.0])  # α 3/4; 2 drafts: no positional evidence
    assert fresh.expected_tokens() == pytest.approx(
        [1 + 0.75, 1 + 0.75 + 0.75**2, 1 + 0.75 + 0.75**2 + 0.75**3], rel=1e-12)

    policy = GammaPolicy(5)
    # γ 3: what follows position 3 is not folded in
    policy.observe(3, 3.0, 4.0, [4, 4, 4, 9, 9], [4, 2, 1, 9, 9])
    policy.observe(2, 1.0, 1.0, [1, 1, 7, 7, 7], [1, 0, 7, 7, 7])  # γ 2: position 3 keeps
    assert policy.alpha == pytest.approx([0.8 * 3 + 1, 0.8 * 4 + 1], rel=1e-12)
    np.testing.assert_allclose(policy.drafted, [4.2, 4.2, 4, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(policy.accepted, [4.2, 1.6, 1, 0, 0], rtol=1e-12)
    # P(first i accepted): 4.2/4.2, 1.6/4.2 = 8/21, 1/4 (4 drafts: still evidence), then
    # x (1/4) / (8/21) = 21/32 per position
    p = [1, 8 / 21, 1 / 4, 1 / 4 * 21 / 32, 1 / 4 * (21 / 32) ** 2]
    assert policy.expected_tokens() == pytest.approx(np.cumsum([1] + p)[1:], rel=1e-12)
    # tokens / (γc + 1) at c = 0.1: 1.818, 1.984, 2.024, 1.996, 1.935
    assert [policy.choose(c) for c in (0.0, 0.1, 0.3)] == [5, 3, 1]
