"""Cache identity: what may and may not share states, and the miss causes that explain it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_matches_forward, assert_same, engine, params

import kvjax
from kvjax import CacheNamespace, PageAllocator, Request, SamplingConfig
from kvjax.cache.trie import PrefixTrie, history_digests

PROMPT = list(range(2, 32))  # 30 tokens: 7 full pages of 4
V = CONFIG.vocab_size


@pytest.fixture(scope="module")
def p():
    return params()


@pytest.fixture(scope="module")
def adapters():
    return {"a": kvjax.init_adapter(CONFIG, rank=4, seed=1),
            "b": kvjax.init_adapter(CONFIG, rank=2, seed=2)}


def _twice(eng, first: Request, second: Request):
    return eng.generate([first])[0], eng.generate([second])[0]


def test_adapter_is_part_of_the_namespace(p, adapters):
    eng = engine(p, adapters=adapters)
    base, tuned = _twice(eng, Request(PROMPT, 6, return_logits=True),
                         Request(PROMPT, 6, adapter="a", return_logits=True))
    assert tuned.stats["reused_tokens"] == 0
    assert tuned.stats["miss_cause"] == "namespace"
    assert tuned.stats["miss_fields"] == ["adapter"]
    fresh = engine(p, adapters=adapters).generate([Request(PROMPT, 6, adapter="a",
                                                           return_logits=True)])
    assert_same([tuned], fresh)
    assert_matches_forward(p, [Request(PROMPT, 6)], [tuned], adapter=adapters["a"])
    assert not np.array_equal(base.logits, tuned.logits)
    again = eng.generate([Request(PROMPT, 6, adapter="a", return_logits=True)])[0]
    assert again.stats["reused_tokens"] == 28
    assert_same([again], fresh)


def test_mixed_adapters_in_one_batch_match_their_fresh_outputs(p, adapters):
    requests = [Request(PROMPT[:n], 5, adapter=a, return_logits=True)
                for n, a in ((30, None), (25, "a"), (27, "b"), (29, "a"))]
    batched = engine(p, adapters=adapters).generate(requests)
    for request, result in zip(requests, batched, strict=True):
        alone = engine(p, adapters=adapters, max_slots=4).generate([request])
        assert_same([result], alone)
        assert_matches_forward(p, [request], [result],
                               adapter=adapters.get(request.adapter))


def test_position_base_is_part_of_the_namespace(p):
    eng = engine(p)
    _, shifted = _twice(eng, Request(PROMPT, 4), Request(PROMPT, 4, position_base=3,
                                                         return_logits=True))
    assert shifted.stats["reused_tokens"] == 0
    assert shifted.stats["miss_fields"] == ["position_base"]
    assert_same([shifted], engine(p).generate([Request(PROMPT, 4, position_base=3,
                                                       return_logits=True)]))


def test_changed_weights_change_the_fingerprint(p):
    eng = engine(p)
    eng.generate([Request(PROMPT, 4)])
    old = eng.fingerprint
    nudged = jax.tree_util.tree_map(lambda x: x, p)
    nudged["layer_1"]["mlp"]["down"]["kernel"] = nudged["layer_1"]["mlp"]["down"]["kernel"] \
        .at[0, 0].add(1e-3)
    eng.load_params(nudged)
    assert eng.fingerprint != old
    after = eng.generate([Request(PROMPT, 4, return_logits=True)])[0]
    assert after.stats["reused_tokens"] == 0
    assert after.stats["miss_fields"] == ["model"]
    assert_same([after], engine(nudged).generate([Request(PROMPT, 4, return_logits=True)]))


def test_tenant_salt_and_public_prefix(p):
    eng = engine(p)
    _, b = _twice(eng, Request(PROMPT, 4, tenant="alice"),
                  Request(PROMPT, 4, tenant="bob", return_logits=True))
    assert b.stats["reused_tokens"] == 0
    assert b.stats["miss_fields"] == ["salt"]
    assert_same([b], engine(p).generate([Request(PROMPT, 4, return_logits=True)]))
    # A declared public prefix (a shared system prompt) is shared across tenants; the rest
    # stays private.
    eng = engine(p)
    _, carol = _twice(eng, Request(PROMPT, 4, tenant="alice", public_prefix=13),
                      Request(PROMPT, 4, tenant="carol", public_prefix=13))
    assert carol.stats["reused_tokens"] == 12
    assert carol.stats["miss_cause"] == "namespace"
    assert carol.stats["miss_fields"] == ["salt"]
    same = eng.generate([Request(PROMPT, 4, tenant="carol", public_prefix=13)])[0]
    assert same.stats["reused_tokens"] == 28


def test_cache_dtype_is_part_of_the_namespace():
    ns = CacheNamespace(model="m", adapter="none", position_base=0, attention="causal",
                        kv_dtype="float32")
    trie = PrefixTrie(4, PageAllocator(8))
    trie.allocator.allocate(2)
    digests = history_digests(PROMPT[:8], 4)
    trie.insert(ns, PROMPT[:8], [None, None], digests, [0, 1])
    other = CacheNamespace(model="m", adapter="none", position_base=0, attention="causal",
                           kv_dtype="bfloat16")
    match = trie.match(other, PROMPT[:8], [None, None], digests)
    assert match.nodes == []
    assert (match.cause, match.fields) == ("namespace", ["kv_dtype"])
    assert trie.match(ns, PROMPT[:8], [None, None], digests).pages == [0, 1]


def test_bfloat16_engine_reuses_exactly(p):
    cache = CACHE.__class__(page_size=4, num_pages=96, dtype="bfloat16", prefill_chunk=16,
                            attn_block=8)
    requests = [Request(PROMPT, 5, return_logits=True), Request(PROMPT + [3, 4], 5,
                                                                return_logits=True)]
    on = engine(p, cache=cache).generate(requests)
    off = engine(p, cache=cache, prefix_cache=False).generate(requests)
    assert on[1].stats["reused_tokens"] == 28
    assert_same(on, off)


def test_sampling_settings_are_not_part_of_the_namespace(p):
    eng = engine(p)
    _, hot = _twice(eng, Request(PROMPT, 4),
                    Request(PROMPT, 4, sampling=SamplingConfig(temperature=1.3, top_k=5,
                                                               top_p=0.8, seed=9),
                            return_logits=True))
    assert hot.stats["reused_tokens"] == 28
    assert hot.stats["miss_cause"] is None
    cold = engine(p).generate([Request(PROMPT, 4, sampling=SamplingConfig(
        temperature=1.3, top_k=5, top_p=0.8, seed=9), return_logits=True)])
    assert_same([hot], cold)


def test_hash_collisions_never_return_another_history(p):
    """Every child of a node lands in one hash bucket; matches still compare tokens."""
    rng = np.random.default_rng(0)
    requests = [Request([int(t) for t in rng.integers(0, 4, size=n)], 4, return_logits=True)
                for n in rng.integers(9, 30, size=10)]
    requests += [Request(list(r.tokens), 4, return_logits=True) for r in requests[:4]]
    colliding = engine(p, hash_fn=lambda salt, tokens: 0)
    normal = engine(p)
    got, expected = colliding.generate(requests), normal.generate(requests)
    assert_same(got, expected)
    assert_same(got, engine(p, prefix_cache=False).generate(requests))
    assert [r.stats["reused_tokens"] for r in got] == \
        [r.stats["reused_tokens"] for r in expected]
    for r in got[-4:]:  # repeats: everything but the last token's page is reused
        assert r.stats["reused_tokens"] == (r.stats["prompt_tokens"] - 1) // 4 * 4
    # Every cached block still holds the tokens of its own history.
    for _, history, _page in colliding.trie.entries():
        assert any(list(r.tokens[:len(history)]) == history for r in requests)
