"""Bad input gets a clear error, allocates nothing, and the pool keeps serving."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import random_tokens, small_model

import kvjax
from kvjax import CacheConfig, InvalidRequestError, KVPool, NonCausalCacheError
from kvjax.decode import steps


@pytest.fixture(scope="module")
def setup():
    config = small_model(max_seq_len=64)
    return config, kvjax.init_params(config, seed=0)


@pytest.mark.parametrize(("prompts", "max_new", "message"), [
    ([[1, 2, -1]], 4, "token id -1 at index 2 is outside the vocabulary"),
    ([[1, 61]], 4, "token id 61 at index 1 is outside the vocabulary"),
    ([[1, 2], []], 4, "prompt 1 is empty"),
    ([], 4, "non-empty list"),
    ([[1.5, 2.0]], 4, "non-integer token ids"),
    ([[1] * 60], 5, "exceed the model's context max_seq_len=64"),
    ([[1, 2]], 0, "max_new_tokens must be an integer >= 1"),
    ([[1] * 40, [2] * 40], 20, "only 16 of 16 pages are free"),
])
def test_bad_request_is_refused_before_allocating(setup, prompts, max_new, message):
    config, params = setup
    pool = KVPool(config, CacheConfig(page_size=4, num_pages=16, prefill_chunk=16,
                                      attn_block=8))
    cache_before = pool.cache
    with pytest.raises(InvalidRequestError, match=message):
        kvjax.generate(params, config, prompts, max_new, cache=pool)
    assert pool.allocator.num_free == 16
    assert pool.cache is cache_before
    assert not pool.cache.k.is_deleted()
    # The pool keeps serving a good request afterwards, and gets every page back.
    good = kvjax.generate(params, config, [[1, 2, 3]], 4, cache=pool)
    ref = kvjax.generate(params, config, [[1, 2, 3]], 4)
    assert good.tokens == ref.tokens
    assert pool.allocator.num_free == 16


def test_non_causal_config_is_refused_by_every_cached_path(setup):
    config, params = setup
    bidirectional = dataclasses.replace(config, causal=False)
    cache_cfg = CacheConfig(page_size=4, num_pages=16, prefill_chunk=16, attn_block=8)
    for call in (
        lambda: kvjax.generate(params, bidirectional, [[1, 2]], 3, cache=cache_cfg),
        lambda: KVPool(bidirectional, cache_cfg),
        lambda: steps.extend(params, bidirectional, kvjax.init_cache(config, cache_cfg),
                             np.zeros((1, 16), np.int32),
                             kvjax.BatchInfo(np.zeros((1, 2), np.int32), np.zeros(1, np.int32),
                                             np.ones(1, np.int32))),
    ):
        with pytest.raises(NonCausalCacheError, match="bidirectional attention"):
            call()
    # The uncached reference still serves it: a token sees later tokens.
    (seq,) = random_tokens(0, [8], config.vocab_size)
    a = np.asarray(kvjax.forward(params, bidirectional, np.array([seq]))[0])
    b = np.asarray(kvjax.forward(params, bidirectional, np.array([[*seq[:-1], seq[-1] ^ 1]]))[0])
    assert not np.array_equal(a[0], b[0])


def test_pool_of_another_model_is_refused(setup):
    config, params = setup
    pool = KVPool(dataclasses.replace(config, num_layers=1),
                  CacheConfig(page_size=4, num_pages=16, prefill_chunk=16, attn_block=8))
    with pytest.raises(InvalidRequestError, match="another model config"):
        kvjax.generate(params, config, [[1, 2]], 3, cache=pool)
    assert pool.allocator.num_free == 16


def test_stop_token_outside_vocabulary(setup):
    config, params = setup
    pool = KVPool(config, CacheConfig(page_size=4, num_pages=16, prefill_chunk=16,
                                      attn_block=8))
    with pytest.raises(InvalidRequestError, match="stop_token 99"):
        kvjax.generate(params, config, [[1, 2]], 3, cache=pool, stop_token=99)
    assert pool.allocator.num_free == 16
