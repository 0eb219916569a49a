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


def test_the_decode_benchmark_point_runs_paged_and_dense_in_each_float_format():
    """`kvjax bench decode` at toy size, float32 and bfloat16 caches: every figure measured.
    (Seen failing: the noise filler read a scale the dense cache does not have.) A bfloat16
    dense cache holds its bits on CPU and reads back the numbers written."""
    from kvjax.bench.decode import bench_point
    from kvjax.cache.dense import dense_write_kv

    config = small_model()
    params = sharp_params(config, seed=2)
    for dtype in ("float32", "bfloat16"):
        row = bench_point(params, config, kvjax.CacheConfig(page_size=8, num_pages=16,
                                                            dtype=dtype),
                          batch=2, context=16, decode_steps=2, reps=1, bandwidth=1e10)
        assert all(row[k] > 0 for k in ("paged_step_ms", "dense_step_ms", "floor_ms"))
    cache = init_dense_cache(config, batch=1, max_len=8, dtype="bfloat16")
    assert cache.k.dtype == np.uint16 and cache.dtype == np.dtype("bfloat16")
    k = np.random.default_rng(0).standard_normal((1, 3, config.num_kv_heads, config.head_dim))
    batch = BatchInfo(np.zeros((1, 0), np.int32), np.zeros(1, np.int32), np.ones(1, np.int32) * 3)
    cache = dense_write_kv(cache, 0, k.astype(np.float32), k.astype(np.float32), batch)
    np.testing.assert_array_equal(np.asarray(cache.read(cache.k[0, 0, :3]), np.float32),
                                  k[0].astype("bfloat16").astype(np.float32))
