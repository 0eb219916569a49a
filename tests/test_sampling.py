from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax.decode.sampling import adjusted_logits, sample, sequence_keys

LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 3.0, 0.25]], np.float32)


def _knobs(b, temperature=1.0, top_k=0, top_p=1.0):
    return (np.full(b, temperature, np.float32), np.full(b, top_k, np.int32),
            np.full(b, top_p, np.float32))


def test_top_k_keeps_exactly_the_k_largest():
    out = np.asarray(adjusted_logits(LOGITS, *_knobs(1, top_k=3)))
    assert set(np.flatnonzero(np.isfinite(out[0]))) == {6, 0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.exp(LOGITS[0]) / np.exp(LOGITS[0]).sum()
    order = np.argsort(-probs)
    for p in (0.3, 0.6, 0.9, 0.99):
        need = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
        out = np.asarray(adjusted_logits(LOGITS, *_knobs(1, top_p=p)))
        assert set(np.flatnonzero(np.isfinite(out[0]))) == set(order[:need].tolist())


def test_temperature_zero_top_k_1_and_tiny_top_p_are_greedy():
    keys = sequence_keys(0, 1)
    pos = np.zeros(1, np.int32)
    for knobs in (_knobs(1, temperature=0.0), _knobs(1, top_k=1), _knobs(1, top_p=1e-4)):
        assert int(sample(LOGITS, keys, pos, *knobs)[0]) == 6


def test_sampled_frequencies_match_the_tempered_softmax():
    n = 4000
    logits = np.repeat(LOGITS, n, axis=0)
    keys = sequence_keys(3, n)
    temperature = 1.7
    drawn = np.asarray(jax.jit(sample)(logits, keys, np.zeros(n, np.int32),
                                       *_knobs(n, temperature=temperature)))
    freq = np.bincount(drawn, minlength=8) / n
    scaled = LOGITS[0] / temperature
    expected = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    assert np.abs(freq - expected).max() < 0.03


def test_keys_depend_on_seed_sequence_and_position_only():
    """Uniform logits over 50 tokens, 400 sequences: independent keys per sequence spread
    the draws over (nearly) every token; another seed or position redraws ~98% of them.
    Keys shared by the sequences (or ignoring seed / position) give one token, or 100%
    equal draws."""
    n = 400
    logits = np.zeros((n, 50), np.float32)
    knobs = _knobs(n)
    draw = jax.jit(sample)
    at = lambda p: np.full(n, p, np.int32)  # noqa: E731
    a = np.asarray(draw(logits, sequence_keys(1, n), at(5), *knobs))
    np.testing.assert_array_equal(a, draw(logits, sequence_keys(1, n), at(5), *knobs))
    assert len(set(a.tolist())) >= 45  # 50 * (1 - (49/50)^400) = 50.0 expected
    other_seed = np.asarray(draw(logits, sequence_keys(2, n), at(5), *knobs))
    other_position = np.asarray(draw(logits, sequence_keys(1, n), at(6), *knobs))
    assert np.mean(a == other_seed) < 0.1  # 0.02 expected
    assert np.mean(a == other_position) < 0.1


def _tail_logits(vocab: int) -> np.ndarray:
    """Four rows of logits with scale 3: a long tail holding real probability mass."""
    return (np.random.default_rng(0).standard_normal((4, vocab)) * 3).astype(np.float32)


@pytest.mark.parametrize("vocab", [32_000, 128_000])
def test_top_p_one_keeps_every_token(vocab):
    """top_p = 1 is "off": every token keeps its logit (a float32 running sum reaches 1.0
    before the tail and used to drop 1,104 of 4 x 32,000 and 240 of 4 x 128,000 here)."""
    logits = _tail_logits(vocab)
    for top_p in (1.0, 1.5):
        out = np.asarray(adjusted_logits(logits, *_knobs(4, top_p=top_p)))
        np.testing.assert_array_equal(out, logits)


def test_top_p_cut_matches_a_float64_reference():
    """Kept set sizes equal the float64 computation (of the float32 top_p) at every p,
    up to 0.9999 where the cut falls deep in the tail (the running float32 sum was off by
    up to 3 tokens a row at 0.999 and 0.9999)."""
    logits = _tail_logits(32_000)
    exact = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    ranked = -np.sort(-exact / exact.sum(1, keepdims=True), axis=1)
    before = np.cumsum(ranked, axis=1) - ranked
    for top_p in (0.3, 0.9, 0.99, 0.999, 0.9999):
        out = np.asarray(adjusted_logits(logits, *_knobs(4, top_p=top_p)))
        want = np.maximum((before < float(np.float32(top_p))).sum(1), 1)
        np.testing.assert_array_equal(np.isfinite(out).sum(1), want, err_msg=f"{top_p=}")
