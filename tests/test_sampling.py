from __future__ import annotations

import jax
import numpy as np

from kvjax.runtime.sampling import adjusted_logits, sample, sequence_keys

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
    logits = np.zeros((2, 50), np.float32)
    knobs = _knobs(2)
    a = sample(logits, sequence_keys(1, 2), np.array([5, 5], np.int32), *knobs)
    b = sample(logits, sequence_keys(1, 2), np.array([5, 5], np.int32), *knobs)
    c = [int(sample(logits, sequence_keys(1, 2), np.array([p, p], np.int32), *knobs)[0])
         for p in range(6, 16)]
    np.testing.assert_array_equal(a, b)
    assert len(set(c)) > 3
    assert int(a[0]) != int(a[1]) or int(sample(logits, sequence_keys(2, 2), np.array(
        [5, 5], np.int32), *knobs)[0]) != int(a[0])
