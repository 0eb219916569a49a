"""The dense contiguous-cache baseline computes the same logits as the reference."""

from __future__ import annotations

import numpy as np
from helpers import random_tokens, sharp_params, small_model, tol

import kvjax
from kvjax import BatchInfo
from kvjax.cache.dense import init_dense_cache
from kvjax.decode import steps


def test_dense_cache_prefill_and_decode_match_forward():
    config = small_model(sliding_window=9)
    params = sharp_params(config, seed=2)
    seqs = random_tokens(3, [20, 27], config.vocab_size)
    prompt = [6, 13]
    cache = init_dense_cache(config, batch=2, max_len=32)
    tokens = np.zeros((2, 16), np.int32)
    for i, n in enumerate(prompt):
        tokens[i, :n] = seqs[i][:n]
    no_pages = np.zeros((2, 0), np.int32)
    batch = BatchInfo(no_pages, np.zeros(2, np.int32), np.array(prompt, np.int32))
    logits, cache = steps.extend(params, config, cache, tokens, batch)
    got = [[np.asarray(logits[i, :n])] for i, n in enumerate(prompt)]
    lengths = np.array(prompt, np.int32)
    total = np.array([len(s) for s in seqs])
    while np.any(lengths < total):
        active = lengths < total
        step = np.array([[s[min(l, len(s) - 1)]] for s, l in zip(seqs, lengths, strict=True)],
                        np.int32)
        batch = BatchInfo(no_pages, lengths, active.astype(np.int32))
        logits, cache = steps.extend(params, config, cache, step, batch)
        for i in np.flatnonzero(active):
            got[i].append(np.asarray(logits[i, :1]))
        lengths = lengths + active
    for seq, parts in zip(seqs, got, strict=True):
        ref = np.asarray(kvjax.forward(params, config, np.array([seq]))[0])
        assert np.abs(np.concatenate(parts) - ref).max() <= tol(1.1e-5)
