"""Helpers for engine tests: one small model and cache shape shared by all of them (so
compilations are shared), and exact comparisons of results."""

from __future__ import annotations

import dataclasses

import numpy as np
from helpers import sharp_params, small_model, tol

import kvjax
from kvjax import CacheConfig, Engine, EngineConfig

CONFIG = small_model(max_seq_len=256)
CACHE = CacheConfig(page_size=4, num_pages=96, prefill_chunk=16, attn_block=8)
SLOTS = 4
# every compiled step covers the model's whole context (one page-table width per cache
# shape), so the engine tests share compiled steps whatever their lengths; the widths that
# grow with a sequence are tested in tests/test_invariance.py and tests/test_exactness.py
CONTEXT = CONFIG.max_seq_len


def params(seed: int = 1):
    return sharp_params(CONFIG, seed=seed)


def engine(p, cache: CacheConfig = CACHE, adapters=None, hash_fn=None, **kw) -> Engine:
    ec = EngineConfig(cache=cache, max_slots=kw.pop("max_slots", SLOTS),
                      decode_steps=kw.pop("decode_steps", 4),
                      min_context=kw.pop("min_context", CONTEXT), **kw)
    return Engine(p, CONFIG, ec, adapters=adapters, hash_fn=hash_fn)


def with_cache(cache: CacheConfig = CACHE, **kw) -> CacheConfig:
    return dataclasses.replace(cache, **kw)


def assert_same(a_results, b_results) -> None:
    """Identical tokens and bitwise-identical float32 logits."""
    assert len(a_results) == len(b_results)
    for a, b in zip(a_results, b_results, strict=True):
        assert a.tokens == b.tokens
        assert (a.logits is None) == (b.logits is None), "logits on one side only"
        if a.logits is not None:
            la = a.logits if isinstance(a.logits, list) else [a.logits]
            lb = b.logits if isinstance(b.logits, list) else [b.logits]
            for x, y in zip(la, lb, strict=True):
                np.testing.assert_array_equal(x, y)


def assert_matches_forward(p, requests, results, adapter=None) -> None:
    """Each sample's logits match the full-sequence reference within float32 tolerance."""
    for request, result in zip(requests, results, strict=True):
        samples = result.tokens if request.n > 1 else [result.tokens]
        logits = result.logits if request.n > 1 else [result.logits]
        for tokens, lg in zip(samples, logits, strict=True):
            seq = list(request.tokens) + tokens
            full = np.asarray(kvjax.forward(p, CONFIG, np.array([seq]), adapter=adapter,
                                            position_base=request.position_base)[0])
            ref = full[len(request.tokens) - 1: len(seq) - 1]
            assert np.abs(ref - lg).max() <= tol(1.4e-5)
