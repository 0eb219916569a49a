"""Hand-computed workloads: exact reuse counts and miss causes; page hygiene; bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_same, engine, params, with_cache

from kvjax import ConfigError, InvalidRequestError, Request
from kvjax.lab import workloads

A = list(range(1, 13))  # 12 tokens: 3 full pages of 4


@pytest.fixture(scope="module")
def p():
    return params()


def _stats(eng, tokens, **kw):
    return eng.generate([Request(tokens, 3, **kw)])[0].stats


def test_hand_computed_reuse_and_causes(p):
    eng = engine(p)
    s = _stats(eng, A)
    assert (s["reused_tokens"], s["computed_tokens"], s["miss_cause"]) == (0, 12, "cold")
    # Whole prompt cached: the last page is recomputed for the first token's logits.
    s = _stats(eng, A)
    assert (s["reused_tokens"], s["reused_pages"], s["miss_cause"]) == (8, 2, None)
    # Diverges at position 6 (inside page 1).
    s = _stats(eng, A[:6] + [40, 41, 42, 43, 44, 45])
    assert (s["reused_tokens"], s["miss_cause"], s["miss_position"]) == (4, "divergence", 6)
    # The rest of the match falls inside a page: 10 tokens, 2 full pages + 2 that a cached
    # page continues.
    s = _stats(eng, A[:10])
    assert (s["reused_tokens"], s["miss_cause"], s["miss_position"]) == (8, "partial_page", 10)
    # Longer than anything cached: every cached page reused, then cold.
    s = _stats(eng, A + [50, 51, 52, 53, 54])
    assert (s["reused_tokens"], s["miss_cause"]) == (12, "cold")
    # A never-seen prompt shorter than a page is cold; a tail that diverges inside a
    # cached page is a divergence at that position.
    s = _stats(eng, [55, 56, 57])
    assert (s["reused_tokens"], s["miss_cause"]) == (0, "cold")
    s = _stats(eng, A[:9] + [44])
    assert (s["reused_tokens"], s["miss_cause"], s["miss_position"]) == (8, "divergence", 9)
    # Forced eviction of everything: the same prompt is now a capacity miss...
    evicted = eng.trie.evict(CACHE.num_pages)
    assert evicted == eng.metrics()["evictions"] > 0
    s = _stats(eng, A)
    assert (s["reused_tokens"], s["miss_cause"]) == (0, "capacity")
    # ... which an unbounded cache would have served.
    assert s["unbounded_reused_tokens"] == 8
    m = eng.metrics()
    m = eng.metrics()
    assert m["requests"] == 8
    assert m["reused_tokens"] == 8 + 4 + 8 + 12 + 8
    assert m["prompt_tokens"] == 12 * 3 + 12 + 10 + 17 + 3 + 10
    assert m["misses_by_cause"] == {"cold": 3, "divergence": 2, "partial_page": 1,
                                    "capacity": 1}
    assert m["request_hit_rate"] == 5 / 8
    assert m["unbounded_request_hit_rate"] == 6 / 8
    assert m["token_reuse_rate"] == 40 / 88
    assert m["unbounded_token_reuse_rate"] == 48 / 88


def test_partial_page_copy_makes_reuse_token_granular(p):
    eng = engine(p, partial_page_copy=True)
    _stats(eng, A)
    s = _stats(eng, A[:10])
    assert (s["reused_tokens"], s["copied_tokens"]) == (9, 1)
    s = _stats(eng, A[:6] + [40, 41, 42])
    assert (s["reused_tokens"], s["copied_tokens"]) == (6, 2)


def test_metrics_export_as_json_lines(p, tmp_path):
    eng = engine(p)
    eng.generate(workloads.shared_system_prompt(3, 9, 3, CONFIG.vocab_size, 2, seed=1))
    path = tmp_path / "metrics.jsonl"
    eng.write_metrics(path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["reused_tokens"] for x in lines[:3]] == [0, 8, 8]
    m = eng.metrics()  # an EngineMetrics: named fields, the old keys, as_dict for JSON
    assert lines[-1]["aggregate"] == json.loads(json.dumps(m.as_dict())) == dict(m)
    assert m.reused_tokens == m["reused_tokens"] == 16 and "spec" not in m and m.spec is None
    assert list(m)[:2] == ["requests", "request_hit_rate"] and list(m)[-1] == "host_s"
    assert lines[-1]["aggregate"]["resident_bytes"] == \
        lines[-1]["aggregate"]["resident_pages"] * 2 * 2 * 2 * 4 * 8 * 4


def test_poisoned_freed_pages_are_never_read(p):
    """A long random workload with eviction, preemption, n > 1, partial-page copies and a
    cancellation, with every freed (and never written) page filled with NaN on device: no
    NaN reaches any logit, and outputs equal a roomy engine's."""
    rng = np.random.default_rng(3)
    system = [int(t) for t in rng.integers(0, 61, 11)]
    requests = []
    for i in range(30):
        tokens = system[: int(rng.integers(1, 12))] + \
            [int(t) for t in rng.integers(0, 61, int(rng.integers(1, 20)))]
        requests.append(Request(tokens, int(rng.integers(2, 25)), n=1 + (i % 5 == 0),
                                return_logits=True))
    poisoned = engine(p, cache=with_cache(num_pages=24), poison_freed=True,
                      partial_page_copy=True)
    victim = poisoned.submit(Request(system * 2, 20))
    for _ in range(2):
        poisoned.step()
    poisoned.cancel(victim)
    got = poisoned.generate(requests)
    for r in got:
        for lg in (r.logits if isinstance(r.logits, list) else [r.logits]):
            assert np.isfinite(lg).all()
    m = poisoned.metrics()
    assert m["evictions"] > 0
    assert m["preemptions"] > 0
    assert m["partial_copies"] > 0
    assert m["cow_copies"] > 0
    assert_same(got, engine(p, cache=with_cache(num_pages=400)).generate(requests))


def test_load_params_is_refused_while_requests_are_live(p):
    eng = engine(p)
    eng.submit(Request(A, 3))
    with pytest.raises(RuntimeError, match="1 live requests"):
        eng.load_params(p)
    eng.run()
    eng.load_params(p)


def test_eviction_policy_is_pluggable(p):
    from kvjax.cache.trie import EVICTION_POLICIES

    EVICTION_POLICIES["longest_first"] = lambda n: (-len(n.tokens), n.last_used)
    try:
        eng = engine(p, cache=with_cache(num_pages=24), eviction="longest_first")
        requests = workloads.few_shot(4, 3, 6, 5, CONFIG.vocab_size, 3, seed=2,
                                      return_logits=True)
        assert_same(eng.generate(requests), engine(p).generate(requests))
    finally:
        del EVICTION_POLICIES["longest_first"]
    with pytest.raises(ConfigError, match=r"engine\.eviction"):
        engine(p, eviction="longest_first")


@pytest.mark.parametrize(("request_", "message"), [
    (Request([], 3), "empty"),
    (Request([1, 2, 61], 3), "token id 61 at index 2 is outside the vocabulary"),
    (Request([1, -2], 3), "token id -2"),
    (Request([1, 2], 3, adapter="nope"), "unknown adapter 'nope'"),
    (Request(list(range(50)) * 4, 40), "more than the whole cache"),
    (Request([1, 2], 3, n=5), "n=5"),
    (Request([1, 2], 0), "max_new_tokens"),
    (Request([1, 2] * 100, 100), "exceed max_seq_len=256"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(p, request_, message):
    eng = engine(p, cache=with_cache(num_pages=48))
    good = Request(A, 5, return_logits=True)
    first = eng.submit(good)
    with pytest.raises(InvalidRequestError, match=message):
        eng.submit(request_)
    second = eng.submit(good)
    results = eng.run()
    assert set(results) == {first, second}
    assert_same([results[first]], [results[second]])
    held = set(eng.trie.pages())
    assert eng.allocator.num_free + len(held) == 48


def test_request_stats_become_the_results_plain_keys():
    """A result's stats dict: nothing before admission but the preemptions it had, the
    admission's keys once admitted, the draft's reuse and the spec counters where present
    (plain data: a copy, JSON-ready)."""
    from kvjax.engine.request_stats import ADMISSION_KEYS, RequestStats
    from kvjax.speculative.stats import SpecStats

    s = RequestStats()
    assert s.as_dict() == {}
    s.preemptions = 2
    assert s.as_dict() == {"preemptions": 2}
    s.admitted, s.miss_cause, s.miss_fields = True, "namespace", ["adapter"]
    s.draft_reused_tokens, s.spec = 8, SpecStats.empty(3)
    out = s.as_dict()
    assert list(out) == [*ADMISSION_KEYS, "draft_reused_tokens", "spec"]
    assert out["preemptions"] == 2 and out["miss_fields"] == ["adapter"]
    assert out["miss_fields"] is not s.miss_fields
    json.dumps(out)
