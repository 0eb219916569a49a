"""Bitwise promises of the paged path, and the verify step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    cached_logits,
    gather_sequence,
    prefill,
    random_tokens,
    sharp_params,
    small_model,
    tol,
)

import kvjax
from kvjax import BatchInfo, CacheConfig, init_cache
from kvjax.decode import steps
from kvjax.decode.batching import page_table

CACHE = CacheConfig(page_size=4, num_pages=64, prefill_chunk=16, attn_block=8)


@pytest.fixture(scope="module")
def model():
    config = small_model(sliding_window=13)
    return config, sharp_params(config, seed=7)


def test_perturbing_the_future_leaves_the_past_bitwise_unchanged(model):
    config, params = model
    t = 10
    (seq,) = random_tokens(0, [30], config.vocab_size)
    other = seq[: t + 1] + [(x + 1) % config.vocab_size for x in seq[t + 1:]]
    full_a = np.asarray(kvjax.forward(params, config, np.array([seq]))[0])
    full_b = np.asarray(kvjax.forward(params, config, np.array([other]))[0])
    np.testing.assert_array_equal(full_a[: t + 1], full_b[: t + 1])
    assert not np.array_equal(full_a[t + 1:], full_b[t + 1:])
    (cached_a,), _, _ = cached_logits(params, config, CACHE, [seq], [20])
    (cached_b,), _, _ = cached_logits(params, config, CACHE, [other], [20])
    np.testing.assert_array_equal(cached_a[: t + 1], cached_b[: t + 1])
    assert not np.array_equal(cached_a[t + 1:], cached_b[t + 1:])


def test_shuffled_physical_pages_give_bitwise_identical_outputs(model):
    config, params = model
    seqs = random_tokens(1, [11, 26, 37], config.vocab_size)
    prompt_lens = [5, 20, 30]
    plain, cache_a, rows_a = cached_logits(params, config, CACHE, seqs, prompt_lens)
    shuffled, cache_b, rows_b = cached_logits(params, config, CACHE, seqs, prompt_lens,
                                              shuffle_seed=3)
    assert rows_a != rows_b
    for a, b in zip(plain, shuffled, strict=True):
        np.testing.assert_array_equal(a, b)
    for seq, ra, rb in zip(seqs, rows_a, rows_b, strict=True):
        for x, y in zip(gather_sequence(cache_a, ra, len(seq)),
                        gather_sequence(cache_b, rb, len(seq)), strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("split", [4, 8, 12, 16, 20, 32, 36])
def test_split_prefill_is_bitwise_identical_to_unsplit(model, split):
    config, params = model
    (seq,) = random_tokens(2, [40], config.vocab_size)
    pages = list(range(10))
    whole, cache_whole = prefill(params, config, CACHE, init_cache(config, CACHE), seq, pages)
    first, cache = prefill(params, config, CACHE, init_cache(config, CACHE), seq[:split], pages)
    rest, cache = prefill(params, config, CACHE, cache, seq, pages, start=split)
    np.testing.assert_array_equal(whole, np.concatenate([first, rest]))
    for x, y in zip(gather_sequence(cache_whole, pages, 40), gather_sequence(cache, pages, 40),
                    strict=True):
        np.testing.assert_array_equal(x, y)


def test_page_table_width_changes_no_bit(model):
    """Padding the page table to more attention blocks leaves every bit unchanged."""
    config, params = model
    (seq,) = random_tokens(6, [13], config.vocab_size)
    pages = [0, 1, 2, 3]
    results = []
    for width in (4, 8, 32):
        cache = init_cache(config, CACHE)
        batch = BatchInfo(page_table=np.array([pages + [0] * (width - 4)], np.int32),
                          lengths=np.zeros(1, np.int32), num_new=np.array([13], np.int32))
        tokens = np.zeros((1, 16), np.int32)
        tokens[0, :13] = seq
        logits, cache = steps.extend(params, config, cache, tokens, batch)
        results.append((np.asarray(logits[0, :13]), *gather_sequence(cache, pages, 13)))
    for other in results[1:]:
        for x, y in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(x, y)
    assert page_table([[0]], 1, CACHE.block_pages).shape[1] == 2 * CACHE.block_pages


def test_verify_over_k_plus_1_tokens_equals_single_decode_steps(model):
    """One extend over k+1 tokens (ragged per sequence) == k+1 one-token decode steps, bitwise
    (measured: 0. On XLA CPU the verify's 10 rows and the decode's 2 are one matmul bit
    class, see DESIGN.md; a change of class fails here first)."""
    config, params = model
    k_plus_1 = [5, 3]
    seqs = random_tokens(3, [14 + 5, 21 + 3], config.vocab_size)
    prompt_lens = [14, 21]
    rows = [list(range(8)), list(range(8, 16))]
    table = page_table(rows, 2, CACHE.block_pages)

    def prefilled():
        cache = init_cache(config, CACHE)
        for seq, n, row in zip(seqs, prompt_lens, rows, strict=True):
            _, cache = prefill(params, config, CACHE, cache, seq[:n], row)
        return cache

    tokens = np.zeros((2, 5), np.int32)
    for i, (seq, n, k) in enumerate(zip(seqs, prompt_lens, k_plus_1, strict=True)):
        tokens[i, :k] = seq[n:n + k]
    batch = BatchInfo(page_table=table, lengths=np.array(prompt_lens, np.int32),
                      num_new=np.array(k_plus_1, np.int32))
    verify_logits, verify_cache = steps.extend(params, config, prefilled(), tokens, batch)
    verify_logits = np.asarray(verify_logits)

    cache = prefilled()
    lengths = np.array(prompt_lens, np.int32)
    for step in range(5):
        active = np.array([step < k for k in k_plus_1])
        batch = BatchInfo(page_table=table, lengths=lengths, num_new=active.astype(np.int32))
        logits, cache = steps.extend(params, config, cache, tokens[:, step:step + 1], batch)
        for i in np.flatnonzero(active):
            np.testing.assert_array_equal(np.asarray(logits[i, 0]), verify_logits[i, step])
        lengths = lengths + active
    for seq, n, k, row in zip(seqs, prompt_lens, k_plus_1, rows, strict=True):
        for x, y in zip(gather_sequence(verify_cache, row, n + k),
                        gather_sequence(cache, row, n + k), strict=True):
            np.testing.assert_array_equal(x, y)
        full = np.asarray(kvjax.forward(params, config, np.array([seq]))[0])
        i = seqs.index(seq)
        err = np.abs(full[n:n + k] - verify_logits[i, :k]).max()
        assert err <= tol(7.0e-6)


def test_recompile_guard_200_decode_steps_across_page_boundaries():
    """200 one-token steps from length 5 (page size 4: 50 page boundaries) compile <= 5
    times: the page table width is bucketed to powers of two of the attention block."""
    config = small_model(num_layers=1, vocab_size=37)  # a config no other test compiles
    params = sharp_params(config, seed=0)
    cache_cfg = CacheConfig(page_size=4, num_pages=64, prefill_chunk=16, attn_block=16)
    cache = init_cache(config, cache_cfg)
    (seq,) = random_tokens(4, [205], config.vocab_size)
    rows = list(range(2))
    _, cache = prefill(params, config, cache_cfg, cache, seq[:5], rows)
    before = steps.trace_counts().get("extend", 0)
    length = 5
    for _ in range(200):
        if length // cache_cfg.page_size >= len(rows):
            rows.append(len(rows))
        batch = BatchInfo(page_table=page_table([rows], 1, cache_cfg.block_pages),
                          lengths=np.array([length], np.int32), num_new=np.ones(1, np.int32))
        logits, cache = steps.extend(params, config, cache, np.array([[seq[length]]], np.int32),
                                     batch)
        length += 1
    compiles = steps.trace_counts()["extend"] - before
    assert 1 <= compiles <= 4, compiles  # widths 8, 16, 32, 64 pages
    full = np.asarray(kvjax.forward(params, config, np.array([seq]))[0])
    assert np.abs(np.asarray(logits[0, 0]) - full[204]).max() <= tol(6.7e-6)


def test_generate_compiles_decode_loop_once_per_bucket():
    config = small_model(num_layers=1, vocab_size=41)
    params = kvjax.init_params(config, seed=0)
    prompts = random_tokens(5, [6, 9], config.vocab_size)
    cache = kvjax.KVPool(config, CacheConfig(page_size=4, num_pages=32, prefill_chunk=16,
                                             attn_block=16))
    before = steps.trace_counts().get("decode_loop", 0)
    for n, compiles in ((3, 1), (5, 1), (7, 1), (17, 1), (20, 2), (23, 2), (26, 2)):
        # Buckets: max_steps 16 then 32; the page table covers the context whatever the
        # lengths (`generate.context_pages`)
        assert [len(t) for t in kvjax.generate(params, config, prompts, n, cache=cache).tokens] \
            == [n, n]
        assert steps.trace_counts()["decode_loop"] - before == compiles
    assert cache.allocator.num_free == 32


@pytest.mark.parametrize(("d_model", "chunk", "page_size"),
                         [(64, 64, 4), (128, 128, 16), (256, 64, 16)])
def test_split_prefill_is_bitwise_across_model_and_chunk_shapes(d_model, chunk, page_size):
    """The split-prefill promise on wider models and longer chunks (the token's row inside
    the [1, chunk] shape changes with the split; its bits must not)."""
    config = small_model(d_model=d_model, d_ff=2 * d_model, max_seq_len=512)
    params = kvjax.init_params(config, seed=0)
    cache_cfg = CacheConfig(page_size=page_size, num_pages=64, prefill_chunk=chunk,
                            attn_block=max(page_size, 16))
    (seq,) = random_tokens(2, [3 * chunk], config.vocab_size)
    pages = list(range(-(-3 * chunk // page_size)))
    whole, cache_whole = prefill(params, config, cache_cfg, init_cache(config, cache_cfg), seq,
                                 pages)
    for split in (page_size, chunk // 2 + page_size, 2 * chunk - page_size):
        first, cache = prefill(params, config, cache_cfg, init_cache(config, cache_cfg),
                               seq[:split], pages)
        rest, cache = prefill(params, config, cache_cfg, cache, seq, pages, start=split)
        np.testing.assert_array_equal(whole, np.concatenate([first, rest]))
        for x, y in zip(gather_sequence(cache_whole, pages, len(seq)),
                        gather_sequence(cache, pages, len(seq)), strict=True):
            np.testing.assert_array_equal(x, y)
