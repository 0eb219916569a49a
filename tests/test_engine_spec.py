"""Speculative decoding in the engine (the on-device loop): greedy output (tokens and their
logits, bitwise) equals the target's greedy output for γ 1..8 and both drafters with prefix
reuse on, and a second turn reuses the pages verification wrote, bitwise; cache on == off
bitwise; rollback frees pages and never writes shared ones; hand-built statistics; bad
input is refused. (The sampled output's distribution: tests/test_spec_sampling.py.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, CONTEXT, SLOTS, assert_same, params, with_cache
from helpers import fresh_prefill, gather_sequence, random_tokens, small_model, tol

import kvjax
from kvjax import CacheConfig, Engine, EngineConfig, SamplingConfig
from kvjax.config import ConfigError, SpecConfig
from kvjax.decode import steps
from kvjax.decode.batching import pages_for
from kvjax.engine.requests import Request
from kvjax.errors import InvalidRequestError
from kvjax.speculative.drafters import NGramDrafter
from kvjax.speculative.ngram_device import ngram_propose

DRAFT = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                    max_seq_len=256, tie_embeddings=False)


@pytest.fixture(scope="module")
def target():
    # Random-init weights, not the sharp `params(1)`: test_measured_cost_ratio_and_verify_slope
    # needs the random draft to be accepted now and then (0 < α < 0.3); against the sharp
    # target it never is (α = 0).
    return kvjax.init_params(CONFIG, seed=1)


@pytest.fixture(scope="module")
def sharp_target():
    return params(1)


@pytest.fixture(scope="module")
def draft():
    return kvjax.init_params(DRAFT, seed=5)


def spec_engine(p, spec: SpecConfig | None, draft=None, cache=CACHE, **kw) -> Engine:
    ec = EngineConfig(cache=cache, max_slots=kw.pop("max_slots", SLOTS),
                      decode_steps=kw.pop("decode_steps", 4),
                      min_context=kw.pop("min_context", CONTEXT), **kw)
    return Engine(p, CONFIG, ec, draft=draft, spec=spec)


def waves():
    """A shared system prompt (2 pages) with suffixes of different lengths, some repetitive
    (so prompt lookup finds continuations), in two waves: the second reuses the first's."""
    rng = np.random.default_rng(3)
    system = [int(t) for t in rng.integers(0, 61, 8)]
    motif = [int(t) for t in rng.integers(0, 61, 3)]
    suffixes = [motif * 2, [5, 6, 7], motif * 4 + [9], [int(t) for t in rng.integers(0, 61, 11)]]
    first = [Request(tokens=system + s, max_new_tokens=14) for s in suffixes[:2]]
    second = [Request(tokens=system + s, max_new_tokens=14 + i) for i, s in enumerate(suffixes)]
    return first, second


def run_waves(engine, logits: bool = False):
    first, second = waves()
    if logits:
        first, second = ([dataclasses.replace(r, return_logits=True) for r in wave]
                         for wave in (first, second))
    return engine.generate(first), engine.generate(second)


def continuations(answers) -> list[Request]:
    """The first wave's prompts + their answers + 3 more tokens: a second turn, whose full
    pages of the first turn were written by prefill and by decode or verification."""
    first, _ = waves()
    return [Request(tokens=list(r.tokens) + a.tokens + [1, 2, 3], max_new_tokens=6,
                    return_logits=True) for r, a in zip(first, answers, strict=True)]


# 8-token pages and 32-token attention blocks: every sequence of these tests fits the
# smallest page-table bucket (8 pages), so each γ compiles its loop once, and tests that use
# this cache with the same γ and drafter share that compile. (Page-boundary behaviour is
# tested on the 4-token pages of CACHE.)
ONE_BUCKET = CacheConfig(page_size=8, num_pages=96, prefill_chunk=16, attn_block=32)


@pytest.fixture(scope="module")
def greedy_reference(target):
    """Plain decoding's waves, and the second turns on a cache-off engine."""
    first, second = run_waves(spec_engine(target, None, cache=ONE_BUCKET), logits=True)
    cold = spec_engine(target, None, cache=ONE_BUCKET, prefix_cache=False)
    return first, second, cold.generate(continuations(first))


@pytest.mark.parametrize("drafter", ["model", "ngram"])
# a verification writes γ + 1 tokens on 8-token pages: 2..6 (γ 1..5) stay in a page or cross
# one by where they start, 9 (γ 8) cross one whatever the start; each γ compiles its loop
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 8])
def test_greedy_equals_target_greedy(target, draft, greedy_reference, drafter, gamma):
    traced = steps.trace_counts().get("spec_loop", 0)
    engine = spec_engine(target, SpecConfig(drafter=drafter, gamma=gamma),
                         draft=(draft, DRAFT) if drafter == "model" else None,
                         cache=ONE_BUCKET)
    got = run_waves(engine, logits=True)
    for ref_wave, got_wave in zip(greedy_reference, got, strict=False):
        assert_same(got_wave, ref_wave)  # tokens and the emitted tokens' logits, bitwise
    second = got[1]
    turns = engine.generate(continuations(got[0]))  # reuse pages a verification wrote
    assert_same(turns, greedy_reference[2])
    for request, result in zip(continuations(got[0]), turns, strict=True):
        assert result.stats["reused_tokens"] == (len(request.tokens) - 4) // 8 * 8
    assert all(r.stats["reused_tokens"] >= 8 for r in second)  # the system prompt's pages
    if drafter == "model":  # the draft's pages were reused too: no draft prefill for them
        assert all(r.stats["draft_reused_tokens"] >= 8 for r in second)
    m = engine.metrics()
    assert m["spec"]["drafted"] > 0 and m["spec"]["target_calls"] > 0
    if drafter == "ngram":
        assert m["spec"]["accepted"] > 0
    assert m["free_pages"] == ONE_BUCKET.num_pages - m["resident_pages"]  # nothing leaked
    assert steps.trace_counts().get("spec_loop", 0) - traced <= 1  # one page-table bucket


def test_cache_on_equals_off_bitwise(target, draft):
    _, requests = waves()
    requests += [Request(tokens=r.tokens, max_new_tokens=9, return_logits=True,
                         sampling=SamplingConfig(temperature=0.9, top_k=20, seed=4))
                 for r in requests]
    results = []
    for prefix_cache in (True, False):
        engine = spec_engine(target, SpecConfig(gamma=3), (draft, DRAFT),
                             prefix_cache=prefix_cache)
        results.append(engine.generate([Request(tokens=r.tokens, max_new_tokens=9,
                                                return_logits=True) for r in requests[:4]]
                                       + requests[4:]))
    assert sum(r.stats["reused_tokens"] for r in results[0]) > 0
    assert_same(*results)


def test_logits_match_the_full_sequence_reference(sharp_target, draft):
    _, requests = waves()
    requests = [Request(tokens=r.tokens, max_new_tokens=10, return_logits=True)
                for r in requests]
    results = spec_engine(sharp_target, SpecConfig(gamma=4), (draft, DRAFT),
                          cache=ONE_BUCKET).generate(requests)
    for request, result in zip(requests, results, strict=True):
        seq = list(request.tokens) + result.tokens
        full = np.asarray(kvjax.forward(sharp_target, CONFIG, np.array([seq]))[0])
        ref = full[len(request.tokens) - 1: len(seq) - 1]
        assert np.abs(ref - result.logits).max() <= tol(6.0e-6)


def test_rollback_frees_pages_and_never_writes_shared_pages(target, draft):
    """γ = 8 over page size 4: verifies write across page boundaries and get rolled back.
    After every scheduling round each sequence holds exactly the pages its kept history
    needs, in both pools, and its cache is bitwise a fresh prefill of that history; the
    system prompt's pages (shared through the trie) keep their bits; freed pages are
    poisoned with NaN, so reading one would show in the outputs."""
    first, second = waves()
    engine = spec_engine(target, SpecConfig(gamma=8), (draft, DRAFT), poison_freed=True)
    reference = spec_engine(target, None).generate(first + second)[len(first):]
    engine.generate(first)
    shared = engine.trie.pages()
    before = [np.asarray(a[:, :, shared]) for a in (engine.cache.k, engine.cache.v)]
    for r in second:
        engine.submit(r)
    checked = 0
    while engine.num_waiting or engine.num_running:
        engine.step()
        for seq in (s for s in engine.scheduler.slots if s is not None):
            history = seq.req.tokens + seq.generated[:-1]
            assert seq.length == len(history)
            assert len(seq.pages) == pages_for(seq.length, 4)
            assert len(seq.draft_pages) == pages_for(seq.draft_length, 4)
            assert seq.draft_length in (seq.length - 1, seq.length)
            for cfg, plan, p, cache, pages, n in (  # each model as the engine runs it
                    (engine.config, engine.plan, engine.model.params, engine.cache, seq.pages,
                     seq.length),
                    (engine.spec.config, engine.spec.plan, engine.spec.params,
                     engine.draft_pool.cache, seq.draft_pages, seq.draft_length)):
                fresh = fresh_prefill(p, cfg, CACHE, history[:n], plan)
                for x, y in zip(gather_sequence(cache, pages, n),
                                gather_sequence(fresh, list(range(len(pages))), n),
                                strict=True):
                    np.testing.assert_array_equal(x, y)
            checked += 1
    assert checked > 4
    results = engine.run()
    assert [results[i].tokens for i in sorted(results)] == [r.tokens for r in reference]
    after = [np.asarray(a[:, :, shared]) for a in (engine.cache.k, engine.cache.v)]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    m = engine.metrics()
    assert m["spec"]["wasted"] > 0
    assert m["free_pages"] == CACHE.num_pages - m["resident_pages"]
    draft = engine.draft_pool
    assert draft.allocator.num_free == CACHE.num_pages - draft.trie.num_nodes


def test_memory_pressure_samples_and_adapters(target, draft):
    """A pool too small for the workload (eviction, then preemption and recomputation in
    both pools), n = 2 samples sharing prompt pages (copy on write in both pools), a LoRA
    adapter on the target, NaN-poisoned freed pages: greedy tokens equal the plain
    engine's, and every page is accounted for at the end."""
    first, second = waves()
    requests = [Request(tokens=r.tokens, max_new_tokens=r.max_new_tokens, n=2)
                for r in second[:2]]
    requests += [Request(tokens=r.tokens, max_new_tokens=r.max_new_tokens, adapter="a")
                 for r in second[2:]] + first
    adapters = {"a": kvjax.init_adapter(CONFIG, rank=4, seed=1)}
    # 26 pages: the speculative engine evicts, then preempts (with 30 it only evicts)
    cache = CacheConfig(page_size=4, num_pages=26, prefill_chunk=16, attn_block=8)
    results = []
    for spec in (None, SpecConfig(gamma=3)):
        ec = EngineConfig(cache=cache, max_slots=SLOTS, decode_steps=4, poison_freed=True,
                          min_context=CONTEXT)
        engine = Engine(target, CONFIG, ec, adapters=adapters,
                        draft=(draft, DRAFT) if spec else None, spec=spec)
        results.append(engine.generate(requests))
        m = engine.metrics()
        assert m["free_pages"] == cache.num_pages - m["resident_pages"]
    assert [r.tokens for r in results[1]] == [r.tokens for r in results[0]]
    assert m["preemptions"] > 0 and m["evictions"] > 0 and m["cow_copies"] > 0, m
    draft = engine.draft_pool
    assert draft.trie.evictions > 0 and draft.allocator.copies > 0
    assert draft.allocator.num_free == cache.num_pages - draft.trie.num_nodes


def test_statistics_of_always_right_and_always_wrong_drafts(target, draft):
    """decode_steps 4, 13 new tokens: the first comes from the prefill, then 3 calls with a
    budget of 4 tokens. Always right (the target drafts for itself, γ 4): one round per
    call, drafting 3 (room for 3 more tokens), emitting 4. Always wrong (a draft whose
    logits are all zero proposes token 0, which the target never picks here): 4 rounds
    per call with room for 3, 2, 1, 0 drafts, each emitting one token."""
    requests = [Request(tokens=[3, 1, 4, 1, 5, 9, 2, 6][: 5 + i], max_new_tokens=13)
                for i in range(3)]
    greedy = spec_engine(target, None, cache=ONE_BUCKET).generate(requests)
    assert all(0 not in r.tokens for r in greedy)

    right = spec_engine(target, SpecConfig(gamma=4), (target, CONFIG), cache=ONE_BUCKET)
    assert [r.tokens for r in right.generate(requests)] == [r.tokens for r in greedy]
    s = right.metrics()["spec"]
    assert (s["verifications"], s["drafted"], s["accepted"], s["emitted"]) == (9, 27, 27, 36)
    assert (s["alpha"], s["acceptance_rate"], s["mean_accepted_length"]) == (1.0, 1.0, 4.0)
    assert s["drafted_by_position"] == s["accepted_by_position"] == [9, 9, 9, 0]
    assert s["target_calls"] == 3 and s["wasted"] == 0

    zero = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 if "lm_head" in jax.tree_util.keystr(path) else x, draft)
    wrong = spec_engine(target, SpecConfig(gamma=4), (zero, DRAFT), cache=ONE_BUCKET)
    got = wrong.generate(requests)
    assert [r.tokens for r in got] == [r.tokens for r in greedy]
    w = wrong.metrics()["spec"]
    assert (w["verifications"], w["drafted"], w["accepted"], w["emitted"]) == (36, 54, 0, 36)
    assert (w["alpha"], w["acceptance_rate"], w["mean_accepted_length"]) == (0.0, 0.0, 1.0)
    assert w["drafted_by_position"] == [27, 18, 9, 0] and w["wasted"] == 54
    assert w["target_calls"] == 12
    per_request = got[0].stats["spec"]
    assert (per_request["drafted"], per_request["emitted"]) == (18, 12)
    assert per_request["target_calls"] == 12 and per_request["gamma_history"] == [4, 4, 4]
    # Two samples share the request's calls: each call counts once for the request.
    (pair,) = wrong.generate([dataclasses.replace(requests[0], n=2)])
    assert pair.tokens == [greedy[0].tokens] * 2
    both = pair.stats["spec"]
    assert (both["verifications"], both["emitted"]) == (24, 24)
    assert both["target_calls"] == 12 and both["gamma_history"] == [4, 4, 4]


def test_adaptive_gamma_follows_the_running_alpha(target, draft):
    requests = [Request(tokens=[3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=25)]
    zero = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 if "lm_head" in jax.tree_util.keystr(path) else x, draft)
    greedy = spec_engine(target, None, cache=ONE_BUCKET).generate(requests)
    for drafter, expect in (((target, CONFIG), 6), ((zero, DRAFT), 1)):
        engine = spec_engine(target, SpecConfig(gamma=6, adaptive=True, cost_ratio=0.05,
                                                verify_slope=0.0), drafter, cache=ONE_BUCKET)
        assert [r.tokens for r in engine.generate(requests)] == [r.tokens for r in greedy]
        history = engine.metrics()["spec"]["gamma_history"]
        assert history[0] == 6 and history[-1] == expect


def test_measured_cost_ratio_and_verify_slope(target, draft, monkeypatch):
    """Adaptive γ measures c and s with `spec_cost`, whose timers are faked here with known
    step durations, and reports the speedup model at the run's α and γ.

    Durations in ticks of 1/1024 s: a one-token target step 8, a target verify of
    γ + 1 = 3 tokens 11, a draft step 2 right after a target step (whose step evicted the
    draft's weights) and 1 alone. The lone one-token target step pauses (24) on its 5th call.
      c = (median(t(target + 4 drafts) / t(target)) − 1) / 4 = ((8 + 4·2) / 8 − 1) / 4 = 0.25
          (the isolated draft step would give 1 / 8 = 0.125; a mean over the 9 repeats,
          one of them 16 / 24, would give 0.213)
      s = (median(t(verify of 3) / t(target)) − 1) / (3 − 1) = (11 / 8 − 1) / 2 = 0.1875
    """
    from kvjax.speculative import cost as spec_cost

    timed = []

    def fake_step_timer(models, batch, context):
        ticks, after_target = 0, False
        is_draft = lambda c: c.d_model == DRAFT.d_model  # noqa: E731 (numerics set by the engine)
        for _, config, _, width, repeats in models:
            if is_draft(config):
                ticks += repeats * {(True, 1): 2, (False, 1): 1}[after_target, width]
            else:
                ticks += repeats * {1: 8, 3: 11}[width]  # only these widths may be timed
                after_target = True
        lone_target = len(models) == 1 and not is_draft(models[0][1]) and models[0][2] == 1
        timed.append((batch, context))
        calls = []

        def timer() -> float:
            calls.append(None)
            return (24 if lone_target and len(calls) == 5 else ticks) / 1024

        return timer

    monkeypatch.setattr(spec_cost, "step_timer", fake_step_timer)
    engine = spec_engine(target, SpecConfig(gamma=2, adaptive=True), (draft, DRAFT),
                         cache=ONE_BUCKET)
    engine.generate([Request(tokens=[1, 2, 3], max_new_tokens=13)])
    m = engine.metrics()["spec"]
    assert set(timed) == {(SLOTS, 128)}  # at the engine's batch, over a 128-token context
    assert (m["cost_ratio"], m["verify_slope"]) == (0.25, 0.1875)
    # 12 tokens after the prefill's first, 4 per call: 3 calls. The first has no evidence
    # and drafts SpecConfig.gamma = 2. This random draft is mostly rejected (α < 0.3), and
    # γ = 2 pays only if T(2) / (1 + 2·0.25 + 2·0.1875) > T(1) / (1 + 0.25 + 0.1875), i.e.
    # T(2) − T(1) = P(both drafts accepted) > (1.875 / 1.4375 − 1)·T(1) > 0.30: the later
    # calls draft 1. The run's γ is its mean, 4 / 3, rounded: 1.
    alpha = m["alpha_sum"] / m["alpha_count"]
    assert 0 < alpha < 0.3
    assert m["gamma_history"] == [2, 1, 1]
    # At γ = 1 the model's tokens per round (1 − α²) / (1 − α) = 1 + α, over
    # γc + 1 = 1.25 target steps, or 1.25 + γs = 1.4375 with the verify slope.
    assert m["predicted_speedup"] == pytest.approx((1 + alpha) / 1.25, rel=1e-12)
    assert m["predicted_speedup_verify"] == pytest.approx((1 + alpha) / 1.4375, rel=1e-12)


def test_device_ngram_lookup_equals_the_host_drafter():
    rng = np.random.default_rng(0)
    histories = [[int(t) for t in rng.integers(0, 4, n)] for n in (1, 2, 3, 5, 9, 17, 30)]
    width = 32
    buf = np.zeros((len(histories), width), np.int32)
    for i, h in enumerate(histories):
        buf[i, : len(h)] = h
    lens = np.array([len(h) for h in histories], np.int32)
    for gamma in (1, 3, 6):
        drafts, num = map(np.asarray, ngram_propose(buf, lens, gamma, 3))
        host = NGramDrafter(max_ngram=3)
        for i, h in enumerate(histories):
            expect = host.propose_one(h, gamma)
            assert drafts[i, : num[i]].tolist() == expect


def test_bad_spec_input_is_refused_and_the_engine_keeps_serving(target, draft):
    with pytest.raises(ConfigError, match="draft"):
        spec_engine(target, SpecConfig(drafter="model"))
    other = small_model(vocab_size=40, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="vocab_size"):
        spec_engine(target, SpecConfig(), (kvjax.init_params(other, seed=0), other))
    short = small_model(num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, d_ff=32,
                        max_seq_len=20)
    engine = spec_engine(target, SpecConfig(gamma=2),
                         (kvjax.init_params(short, seed=0), short))
    with pytest.raises(InvalidRequestError, match="draft's max_seq_len"):
        engine.submit(Request(tokens=list(range(15)), max_new_tokens=10))
    ok = engine.generate([Request(tokens=[1, 2, 3], max_new_tokens=5)])
    assert len(ok[0].tokens) == 5
    small = spec_engine(target, SpecConfig(gamma=8), (draft, DRAFT),
                        cache=CacheConfig(page_size=4, num_pages=6, prefill_chunk=16,
                                          attn_block=8))
    with pytest.raises(InvalidRequestError, match="pages"):  # 18 tokens + γ 8 > 6 pages
        small.submit(Request(tokens=[1] * 8, max_new_tokens=10))


def test_the_draft_prompt_is_prefilled_chunk_by_chunk_with_the_targets(sharp_target, draft):
    """A long prompt arriving while another request decodes: each prefill round writes one
    chunk of the target's prompt and one of the draft's (not the draft's whole prompt after
    the target's last chunk), and the greedy tokens equal plain decoding's."""
    spec = SpecConfig(gamma=3)
    e = spec_engine(sharp_target, spec, (draft, DRAFT), cache=with_cache(prefill_chunk=8),
                    max_slots=2)
    short, long = (Request(tokens=t, max_new_tokens=12) for t in
                   random_tokens(9, [5, 40], CONFIG.vocab_size))
    a = e.submit(short)
    e.step()
    b = e.submit(long)
    starts = []
    for _ in range(8):  # 40 tokens in 8-token chunks, one chunk call per round
        e.step()
        entry = next((x for x in e.rounds.prefilling if x.req.id == b), None)
        if entry is not None:
            starts.append((entry.row.start, entry.draft.start))
    assert starts and all(t == d for t, d in starts), starts  # in step, chunk by chunk
    assert [t for t, _ in starts] == list(range(8, 40, 8))[: len(starts)]
    done = e.run()
    plain = spec_engine(sharp_target, None, cache=with_cache(prefill_chunk=8), max_slots=2)
    assert [done[a].tokens, done[b].tokens] == [r.tokens for r in plain.generate([short, long])]
