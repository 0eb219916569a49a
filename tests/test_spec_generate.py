"""Speculative generation: greedy equals the target's greedy output, rollback equals a fresh
prefill bitwise, and the statistics of hand-built drafters come out exactly."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fresh_prefill, gather_sequence, prefill, sharp_params, small_model, tol

import kvjax
from kvjax import CacheConfig, SamplingConfig
from kvjax.speculative.drafters import NGramDrafter
from kvjax.speculative.host import speculative_generate

CACHE = CacheConfig(page_size=4, num_pages=128, prefill_chunk=16, attn_block=8)


@pytest.fixture(scope="module")
def model():
    config = small_model(vocab_size=16, max_seq_len=256)
    return config, sharp_params(config, seed=11)


def _prompts():
    rng = np.random.default_rng(0)
    motif = [int(t) for t in rng.integers(0, 16, 6)]
    return [motif * 3 + [1, 2], motif * 2 + [3], [int(t) for t in rng.integers(0, 16, 9)]]


class Oracle:
    """Proposes the target's own greedy continuation (always right)."""

    def __init__(self, continuations):
        self.continuations = continuations

    def propose(self, histories, gamma, seq_ids=None):
        out = []
        for h in histories:
            for prompt, cont in self.continuations:
                full = prompt + cont
                if full[: len(h)] == list(h):
                    out.append((full[len(h): len(h) + gamma], None))
                    break
        return out


class Contrarian:
    """Proposes a token the target never picks (always wrong)."""

    def __init__(self, continuations):
        self.oracle = Oracle(continuations)

    def propose(self, histories, gamma, seq_ids=None):
        return [([(t + 1) % 16 for t in toks], None)
                for toks, _ in self.oracle.propose(histories, gamma)]


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_speculative_equals_target_greedy(model, gamma):
    config, params = model
    prompts = _prompts()
    reference = kvjax.generate(params, config, prompts, 20, cache=CACHE).tokens
    got = speculative_generate(params, config, prompts, 20, NGramDrafter(), gamma, cache=CACHE)
    assert got.tokens == reference
    assert got.stats.drafted > 0 and got.stats.target_calls < 3 * 20


def test_rollback_leaves_exactly_a_fresh_prefill(model):
    """Rejected drafts wrote K/V past the kept history (across page boundaries, page size
    4, γ = 8); after rollback the kept pages hold bitwise what a fresh prefill of the
    accepted history writes, and pages past the end were returned."""
    config, params = model
    prompts = _prompts()
    res = speculative_generate(params, config, prompts, 24, NGramDrafter(), 8, cache=CACHE,
                               keep_pages=True)
    assert res.stats.wasted > 0
    for prompt, tokens, row, length in zip(prompts, res.tokens, res.rows, res.lengths,
                                           strict=True):
        history = (prompt + tokens)[:length]
        assert len(row) == -(-length // 4)
        fresh = fresh_prefill(params, config, CACHE, history)
        for x, y in zip(gather_sequence(res.pool.cache, row, length),
                        gather_sequence(fresh, list(range(len(row))), length), strict=True):
            np.testing.assert_array_equal(x, y)
    held = sum(len(r) for r in res.rows)
    assert res.pool.allocator.num_free == CACHE.num_pages - held


def test_rollback_with_a_shared_prefix_page_is_bitwise(model):
    """The exact path's verify + rollback on a sequence whose first page is shared with
    another sequence (refcount 2, as after a prefix-cache hit): rounds of 8 random drafts
    (mostly rejected) cross page boundaries; afterwards the sequence's cache is bitwise a
    fresh prefill of its accepted history, the shared page's bits and refcount are
    unchanged, and every page past the end went back to the allocator."""
    from kvjax.decode.batching import free_past
    from kvjax.decode.generate import KVPool
    from kvjax.speculative.host import _verify
    from kvjax.speculative.stats import SpecStats

    config, params = model
    pool = KVPool(config, CACHE)
    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(0, 16, 8)]
    b = a[:4] + [int(t) for t in rng.integers(0, 16, 5)]
    shared = pool.allocator.allocate(1)
    row_a = shared + pool.allocator.allocate(1)
    pool.allocator.share(shared[0])
    row_b = shared + pool.allocator.allocate(2)
    _, pool.cache = prefill(params, config, CACHE, pool.cache, a, row_a)
    _, pool.cache = prefill(params, config, CACHE, pool.cache, b, row_b, start=4)
    before = [np.asarray(x[:, :, shared[0]]) for x in (pool.cache.k, pool.cache.v)]
    history, length, last = list(b), len(b), 3
    stats = SpecStats(accepted_by_position=[0] * 8, drafted_by_position=[0] * 8)
    key = np.zeros(2, np.uint32)
    for _ in range(6):
        draft = [int(t) for t in rng.integers(0, 16, 8)]
        (emitted,) = _verify(params, config, pool, [(row_b, length, last, draft, None, key)],
                             SamplingConfig(), stats, 8, 1, CACHE.prefill_chunk)
        history.append(last)
        history += emitted[:-1]
        length, last = length + len(emitted), emitted[-1]
        free_past(pool.allocator, row_b, length, 4)
    assert stats.wasted > 0 and length == len(history)
    assert len(row_b) == -(-length // 4)
    fresh = fresh_prefill(params, config, CACHE, history)
    for x, y in zip(gather_sequence(pool.cache, row_b, length),
                    gather_sequence(fresh, list(range(len(row_b))), length), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(before, (pool.cache.k[:, :, shared[0]], pool.cache.v[:, :, shared[0]]),
                    strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert pool.allocator.refcount(shared[0]) == 2
    assert pool.allocator.num_free == CACHE.num_pages - len(row_a) - len(row_b) + 1


def test_statistics_of_always_right_and_always_wrong_drafters(model):
    config, params = model
    prompts = _prompts()
    greedy = kvjax.generate(params, config, prompts, 13, cache=CACHE).tokens
    conts = list(zip(prompts, greedy, strict=True))
    right = speculative_generate(params, config, prompts, 13, Oracle(conts), 4, cache=CACHE)
    assert right.tokens == greedy
    s = right.stats
    # 1 token from prefill, then 12 more in rounds of 5 (4 drafts + 1): 5, 5, 2 (1 + 1).
    assert (s.target_calls, s.drafted, s.accepted) == (3 * 3, 3 * 9, 3 * 9)
    assert s.acceptance_rate == 1.0
    assert s.mean_accepted_length == 12 / 3
    assert s.accepted_by_position == s.drafted_by_position == [9, 6, 6, 6]
    wrong = speculative_generate(params, config, prompts, 13, Contrarian(conts), 4, cache=CACHE)
    assert wrong.tokens == greedy
    w = wrong.stats
    assert (w.target_calls, w.accepted, w.acceptance_rate, w.mean_accepted_length) == \
        (3 * 12, 0, 0.0, 1.0)
    assert w.wasted == w.drafted


def test_sampled_speculation_is_reproducible(model):
    config, params = model
    sampling = SamplingConfig(temperature=1.0, seed=4)
    a = speculative_generate(params, config, _prompts(), 16, NGramDrafter(), 3,
                             sampling=sampling, cache=CACHE)
    b = speculative_generate(params, config, _prompts(), 16, NGramDrafter(), 3,
                             sampling=sampling, cache=CACHE)
    assert a.tokens == b.tokens
    assert all(len(t) == 16 for t in a.tokens)
    assert a.stats.drafted > 0


def test_model_drafter_greedy_equals_target_greedy(model):
    from kvjax.speculative.drafters import ModelDrafter

    config, params = model
    prompts = _prompts()
    reference = kvjax.generate(params, config, prompts, 20, cache=CACHE).tokens
    # The target drafting for itself: nearly every draft is accepted.
    self_draft = ModelDrafter(params, config, CACHE)
    got = speculative_generate(params, config, prompts, 20, self_draft, 4, cache=CACHE)
    assert got.tokens == reference
    assert got.stats.acceptance_rate >= 0.9
    assert self_draft.pool.allocator.num_free == CACHE.num_pages  # released
    # A different (random) draft model: the output is still exactly the target's.
    draft_config = small_model(vocab_size=16, num_layers=1, d_model=16, num_heads=2,
                               num_kv_heads=1, d_ff=32, max_seq_len=256)
    other = ModelDrafter(kvjax.init_params(draft_config, seed=3), draft_config, CACHE)
    got = speculative_generate(params, config, prompts, 20, other, 3, cache=CACHE)
    assert got.tokens == reference
    assert got.stats.acceptance_rate < 0.9


def test_model_drafter_sampling_is_reproducible(model):
    from kvjax.speculative.drafters import ModelDrafter

    config, params = model
    sampling = SamplingConfig(temperature=0.8, seed=2)
    runs = [speculative_generate(params, config, _prompts(), 12,
                                 ModelDrafter(params, config, CACHE, sampling), 3,
                                 sampling=sampling, cache=CACHE) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accepted > 0


def test_batched_verify_matches_within_tolerance(model):
    """The fast path scores all sequences in one [slots, γ + 1] call: same greedy tokens
    here, and the kept K/V equal a fresh prefill within float32 tolerance."""
    config, params = model
    prompts = _prompts()
    reference = kvjax.generate(params, config, prompts, 20, cache=CACHE).tokens
    res = speculative_generate(params, config, prompts, 20, NGramDrafter(), 4, cache=CACHE,
                               keep_pages=True, batched_verify=True)
    assert res.tokens == reference
    assert res.stats.target_calls < 20  # one call per round for all sequences
    for prompt, tokens, row, length in zip(prompts, res.tokens, res.rows, res.lengths,
                                           strict=True):
        history = (prompt + tokens)[:length]
        fresh = fresh_prefill(params, config, CACHE, history)
        for x, y in zip(gather_sequence(res.pool.cache, row, length),
                        gather_sequence(fresh, list(range(len(row))), length), strict=True):
            np.testing.assert_allclose(x, y, atol=tol(2.7e-6), rtol=0)


def test_alpha_estimate(model):
    """α = E[min(p, q)]: 1 for an always-right drafter, 0 for an always-wrong one, and in
    sampling mode a probability in (0, 1)."""
    config, params = model
    prompts = _prompts()
    greedy = kvjax.generate(params, config, prompts, 9, cache=CACHE).tokens
    conts = list(zip(prompts, greedy, strict=True))
    assert speculative_generate(params, config, prompts, 9, Oracle(conts), 2,
                                cache=CACHE).stats.alpha == 1.0
    assert speculative_generate(params, config, prompts, 9, Contrarian(conts), 2,
                                cache=CACHE).stats.alpha == 0.0
    hot = speculative_generate(params, config, prompts, 9, NGramDrafter(), 2, cache=CACHE,
                               sampling=SamplingConfig(temperature=1.0, seed=1))
    assert 0.0 < hot.stats.alpha < 1.0


def test_spec_config_and_public_facade(model):
    config, params = model
    spec = kvjax.SpecConfig(drafter="ngram", gamma=3)
    drafter = kvjax.speculative.make_drafter(spec)
    res = kvjax.speculative.speculative_generate(params, config, _prompts(), 10, drafter,
                                                 spec.gamma, cache=CACHE)
    assert res.tokens == kvjax.generate(params, config, _prompts(), 10, cache=CACHE).tokens
    model_drafter = kvjax.speculative.make_drafter(kvjax.SpecConfig(), draft=(params, config),
                                                   cache=CACHE)
    assert isinstance(model_drafter, kvjax.speculative.ModelDrafter)
    with pytest.raises(kvjax.ConfigError, match="gamma"):
        kvjax.SpecConfig(gamma=0)
    with pytest.raises(ValueError, match="draft="):
        kvjax.speculative.make_drafter(kvjax.SpecConfig())
    # rel: measured 1.8e-11 and 2.4e-11 below (the constants' 10 digits)
    assert kvjax.speculative.predicted_speedup(0.8, 4, 0.1) == pytest.approx(2.4011428571,
                                                                              rel=2.5e-10)
    # A verify costing 1 + 0.25·γ target steps: (1 − 0.8^5) / (0.2 · (0.4 + 1 + 1)).
    assert kvjax.speculative.predicted_speedup(0.8, 4, 0.1, 0.25) == pytest.approx(1.4006666667,
                                                                                    rel=2.5e-10)


def test_adaptive_gamma_follows_alpha(model):
    """α = 1 drives γ to its maximum, α = 0 to 1, and α between them to the best γ worked
    out by hand (the smaller on a tie); outputs stay the target's."""
    from kvjax.speculative.gamma import choose_gamma

    assert choose_gamma(1.0, 0.1, 8) == 8
    assert choose_gamma(0.0, 0.1, 8) == 1
    # speedup(γ) = T(γ) / (γc + 1 + sγ), T(γ) = (1 − α^(γ+1)) / (1 − α), by hand:
    # α 0.8, c 0.1: T(5..8) = (1 − 0.8^6..9) / 0.2 = 3.68928, 3.951424, 4.1611392, 4.3289114
    # over 1.5, 1.6, 1.7, 1.8: 2.45952, 2.46964, 2.44773, 2.40495 (γ ≤ 4: ≤ 2.4012): 6.
    assert choose_gamma(0.8, 0.1, 8) == 6
    # With s 0.1 the same T(3..5) = 2.952, 3.3616, 3.68928 over 1.6, 1.8, 2.0:
    # 1.845, 1.86756, 1.84464 (and falling on both sides): 4.
    assert choose_gamma(0.8, 0.1, 8, 0.1) == 4
    # A tie: α 0.5, c 1/12, T(1..4) = 1.5, 1.75, 1.875, 1.9375 over 13/12, 14/12, 15/12,
    # 16/12: 1.3846, 1.5, 1.5, 1.4531 (exactly 1.5 twice in floats too): the smaller, 2.
    assert choose_gamma(0.5, 1 / 12, 8) == 2
    # A costlier verify shortens the best draft.
    assert choose_gamma(0.87, 0.05, 8, 0.125) < choose_gamma(0.87, 0.05, 8)
    config, params = model
    prompts = _prompts()
    greedy = kvjax.generate(params, config, prompts, 25, cache=CACHE).tokens
    conts = list(zip(prompts, greedy, strict=True))
    right = speculative_generate(params, config, prompts, 25, Oracle(conts), 6, cache=CACHE,
                                 adaptive=True, batched_verify=True)
    wrong = speculative_generate(params, config, prompts, 25, Contrarian(conts), 6,
                                 cache=CACHE, adaptive=True, batched_verify=True)
    assert right.tokens == wrong.tokens == greedy
    assert right.stats.gamma_history[-1] == 6
    assert set(wrong.stats.gamma_history[1:]) == {1}
