"""Cache identity: what may and may not share states, and the miss causes that explain it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_helpers import CACHE, CONFIG, assert_matches_forward, assert_same, engine, params

import kvjax
from kvjax import CacheNamespace, ModelConfig, PageAllocator, Request, SamplingConfig
from kvjax.cache.trie import PrefixTrie, history_digests
from kvjax.engine.runner import StepRunner

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


def test_mixed_adapters_in_one_batch_match_their_fresh_outputs(p, adapters, monkeypatch):
    """While a request decodes, prompts with adapters "a", "b" and none arrive and are
    prefilled inside its decode calls (packed steps; none shares more than a page with
    another of its namespace, so each has more than a chunk to prefill): every request gets
    the bits it gets alone and the full-sequence reference's values."""
    filled = []  # the adapter index of every prompt row a packed step prefilled
    packed_fill = StepRunner.packed_fill
    monkeypatch.setattr(StepRunner, "packed_fill", lambda self, rows, *a: filled.extend(
        r.adapter_index for r in rows) or packed_fill(self, rows, *a))
    requests = [Request(tokens, new, adapter=a, return_logits=True) for tokens, new, a in (
        (PROMPT, 16, "a"), (PROMPT[:25], 5, None), (PROMPT[:27], 5, "b"),
        (PROMPT[::-1][:29], 5, "a"))]  # all but the first with more than a chunk to prefill
    eng = engine(p, adapters=adapters, packed_prefill=True)
    ids = [eng.submit(requests[0])]
    eng.step()
    ids += [eng.submit(r) for r in requests[1:]]
    done = eng.run()
    assert set(filled) == {0, 1, 2}
    for request, rid in zip(requests, ids, strict=True):
        alone = engine(p, adapters=adapters, max_slots=1, prefix_cache=False)
        assert_same([done[rid]], alone.generate([request]))
        assert_matches_forward(p, [request], [done[rid]], adapter=adapters.get(request.adapter))


def test_a_prompt_prefilled_in_packed_steps_keeps_its_position_base(p):
    """While a request decodes, a 40-token prompt with position base 3 arrives and is
    prefilled inside the decode calls (packed steps, its own positions): both get the bits
    they get alone, and the full-sequence reference's values."""
    first = Request(PROMPT[:9], 24, return_logits=True)
    second = Request(list(range(10, 50)), 5, position_base=3, return_logits=True)
    eng = engine(p, decode_steps=2, packed_prefill=True)
    ids = [eng.submit(first)]
    eng.step()
    ids.append(eng.submit(second))
    eng.step()
    assert eng.rounds.live[ids[1]].prefilling and eng.rounds._packing()
    done = eng.run()
    alone = engine(p, max_slots=1, prefix_cache=False)
    assert_same([done[rid] for rid in ids], [alone.generate([r])[0] for r in (first, second)])
    assert_matches_forward(p, [second], [done[ids[1]]])


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
    assert (b.stats["miss_cause"], b.stats["miss_fields"]) == ("cold", [])  # alice's: unseen
    assert eng.metrics()["namespace_misses_by_field"] == {"salt": 1}  # the operator's view
    assert_same([b], engine(p).generate([Request(PROMPT, 4, return_logits=True)]))
    # A declared public prefix (a shared system prompt) is shared across tenants; the rest
    # stays private.
    eng = engine(p)
    _, carol = _twice(eng, Request(PROMPT, 4, tenant="alice", public_prefix=13),
                      Request(PROMPT, 4, tenant="carol", public_prefix=13))
    assert carol.stats["reused_tokens"] == 12
    assert carol.stats["miss_cause"] == "cold"
    same = eng.generate([Request(PROMPT, 4, tenant="carol", public_prefix=13)])[0]
    assert same.stats["reused_tokens"] == 28


def _told(result) -> dict:
    """What a request is told, timings aside."""
    return {k: v for k, v in result.stats.items() if not k.endswith("_s")}


@pytest.mark.parametrize(("first", "second", "told"), [
    (Request(PROMPT, 4, tenant="alice"), Request(PROMPT, 4, tenant="bob"), (0, "cold", [])),
    (Request(PROMPT, 4, tenant="alice"), Request(PROMPT, 4), (0, "cold", [])),
    (Request(PROMPT, 4, tenant="alice", adapter="a"), Request(PROMPT, 4), (0, "cold", [])),
    (Request(PROMPT, 4, tenant="alice", public_prefix=13),
     Request(PROMPT, 4, tenant="carol", public_prefix=13), (12, "cold", [])),
    (Request(PROMPT, 4, tenant="alice", public_prefix=13),
     Request(PROMPT[:20] + [1, 2, 3], 4, tenant="carol", public_prefix=13), (12, "cold", [])),
    # public pages are public: bob sees them, under another salt than his own
    (Request(PROMPT, 4), Request(PROMPT, 4, tenant="bob"), (0, "namespace", ["salt"])),
], ids=["salt", "public-asks", "adapter+salt", "public-prefix", "divergent", "public-seen"])
def test_a_request_is_told_only_what_its_namespace_sees(p, adapters, first, second, told):
    """The second request is told its reuse and miss cause as its namespace sees them, and
    its stats are exactly those of an engine where only the public part of the first
    request ran (timings aside): another tenant's private pages do not exist for it. The
    operator's aggregate still counts the namespace miss."""
    eng = engine(p, adapters=adapters)
    eng.generate([first])
    got = eng.generate([second])[0]
    assert (got.stats["reused_tokens"], got.stats["miss_cause"],
            got.stats["miss_fields"]) == told
    public = len(first.tokens) if first.tenant is None else first.public_prefix
    witness = engine(p, adapters=adapters)
    if public:
        eng_public = dataclasses.replace(first, tokens=first.tokens[:public], tenant=None,
                                         public_prefix=0)
        witness.generate([eng_public])
    assert _told(got) == _told(witness.generate([second])[0])
    assert "salt" in eng.metrics()["namespace_misses_by_field"]
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


def test_per_layer_attention_structure_is_part_of_the_signature():
    """Two models whose weights could be equal but whose layers see other keys, rotate by
    other frequencies or weigh scores otherwise never share pages."""
    from kvjax.cache.identity import attention_signature

    base = ModelConfig(num_layers=2, sliding_window=8, layer_types=("sliding", "full"))
    variants = [
        dataclasses.replace(base, layer_types=("full", "sliding")),
        dataclasses.replace(base, layer_types=()),  # every layer slides
        dataclasses.replace(base, local_rope_theta=100.0),
        dataclasses.replace(base, rope_scaling=(("rope_type", "linear"), ("factor", 2.0))),
        dataclasses.replace(base, query_scale=0.5),
        dataclasses.replace(base, attn_softcap=50.0),
        dataclasses.replace(base, causal=False),
        dataclasses.replace(base, rope_theta=500000.0),
        dataclasses.replace(base, position="learned"),
    ]
    signatures = {attention_signature(c) for c in [base, *variants]}
    assert len(signatures) == 1 + len(variants)
    assert attention_signature(base) == attention_signature(dataclasses.replace(base))


def test_fused_products_are_part_of_the_model_identity(p):
    """Two engines that differ only in `fused_projections` run other products (one q/k/v
    and one gate/up product, or separate ones), whose bits are their own: the engines'
    numerics plans differ in them (the model config is the same), and so do the
    fingerprint and the namespace's `model`."""
    fused, plain = engine(p), engine(p, fused_projections=False)
    assert fused.plan.fused and not plain.plan.fused and fused.config == plain.config
    assert dataclasses.replace(fused.plan, fused=False, row_blocks=plain.plan.row_blocks,
                               transposed=plain.plan.transposed) == plain.plan
    assert fused.fingerprint != plain.fingerprint
    request = Request(PROMPT, 4)
    assert fused.namespace(request).differing_fields(plain.namespace(request)) == ["model"]


def test_every_field_of_the_numerics_plan_is_in_the_fingerprint(p):
    """The plan passed beside the model config changes a token's bits in each of its
    fields, so each is in the model fingerprint (hence the namespace); equal plans give
    equal fingerprints, and the engine's is that of its config, weights and plan. The one
    field that changes no bit, the layer loop (tests/test_layer_loop.py), is left out: its
    pages are the unrolled layers'."""
    from kvjax.cache.identity import SAME_BITS, model_fingerprint
    from kvjax.model.plan import NumericsPlan

    base = NumericsPlan("invariant", row_blocks=(("q", 0),), transposed=("q",))
    variants = [
        dataclasses.replace(base, mode="fast"),
        dataclasses.replace(base, row_block=16),
        dataclasses.replace(base, row_blocks=(("q", 0), ("o", 16))),
        dataclasses.replace(base, transposed=()),
        NumericsPlan("invariant", row_blocks=(("qkv", 0),), transposed=("qkv",), fused=True),
        NumericsPlan("invariant", row_blocks=(("q", 0),), cpu_kernel=True),
        dataclasses.replace(base, cpu_attention=True),
    ]
    changed = {f.name for plan in variants for f in dataclasses.fields(plan)
               if getattr(plan, f.name) != getattr(base, f.name)}
    # each field varied once
    assert changed | set(SAME_BITS) == {f.name for f in dataclasses.fields(base)}
    kernels = dataclasses.replace(base, transposed=(), cpu_kernel=True, cpu_attention=True)
    assert model_fingerprint(CONFIG, p, kernels) == model_fingerprint(
        CONFIG, p, dataclasses.replace(kernels, layer_loop=True))
    prints = {model_fingerprint(CONFIG, p, plan) for plan in [base, *variants]}
    assert len(prints) == 1 + len(variants)
    assert model_fingerprint(CONFIG, p, dataclasses.replace(base)) in prints
    assert model_fingerprint(CONFIG, p) not in prints  # the weights' identity alone
    eng = engine(p)
    assert eng.fingerprint == model_fingerprint(eng.config, p, eng.plan)


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
    # the first request's answer filled the prompt's last page, now cached: its 2 prompt
    # tokens are a partly matching page (a partial-page copy could take them)
    assert hot.stats["miss_cause"] == "partial_page"
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
    # Every cached block still holds the tokens of its own history (prompt and answer).
    histories = [list(r.tokens) + res.tokens for r, res in zip(requests, got, strict=True)]
    for _, history, _page in colliding.trie.entries():
        assert any(h[:len(history)] == history for h in histories)


def test_records_of_one_history_under_two_paths_do_not_collide():
    """One tenant's prompt cached twice, with public_prefix 0 (path salts t, t) and 4
    (None, t): block 1 has the same namespace and token history on both paths. Evicting it
    on the first path and caching the second must not erase the first's eviction record
    (its miss is "capacity", not "cold"), and the operator still sees the second path's
    block as the same history under another salt."""
    ns = CacheNamespace(model="m", adapter="none", position_base=0, attention="causal",
                        kv_dtype="float32")
    trie = PrefixTrie(4, PageAllocator(8))
    tokens, digests = PROMPT[:8], history_digests(PROMPT[:8], 4)
    pages = trie.allocator.allocate(4)
    trie.insert(ns, tokens, ["t", "t"], digests, pages[:2])
    trie.allocator.free(pages[:2])
    assert trie.evict(1) == 1  # the leaf: block 1 of the (t, t) path
    assert trie.match(ns, tokens, ["t", "t"], digests).cause == "capacity"
    trie.insert(ns, tokens, [None, "t"], digests, pages[2:])
    trie.allocator.free(pages[2:])
    again = trie.match(ns, tokens, ["t", "t"], digests)
    assert (len(again.nodes), again.cause) == (1, "capacity")
    assert trie.unbounded_blocks(ns, tokens, ["t", "t"]) == 2
    assert trie.unbounded_blocks(ns, tokens, ["u", "u"]) == 0
    # Tenant u with the same public first block: the (None, t) path's block 1 is t's.
    other = trie.match(ns, tokens, [None, "u"], digests)
    assert (len(other.nodes), other.cause, other.fields) == (1, "cold", [])
    assert (other.operator_cause, other.operator_fields) == ("namespace", ["salt"])
    # Both paths resident; evicting the (t, t) block 1 leaves the (None, t) one on record.
    fresh = trie.allocator.allocate(1)
    trie.insert(ns, tokens, ["t", "t"], digests, [trie.match(ns, tokens, ["t", "t"],
                                                             digests).pages[0], *fresh])
    trie.allocator.free(fresh)
    assert trie.match(ns, tokens, ["t", "t"], digests).cause is None
    victim = trie.match(ns, tokens, ["t", "t"], digests).nodes[1]
    trie._remove(victim)
    assert trie.match(ns, tokens, ["t", "t"], digests).cause == "capacity"
    assert trie.match(ns, tokens, [None, "t"], digests).cause is None
    assert trie.match(ns, tokens, [None, "u"], digests).operator_cause == "namespace"


def test_the_operator_sees_the_fields_a_request_cannot():
    """The same tokens are cached publicly under adapter a and privately by alice under
    adapter b. Bob (adapter a) is told of the public copy only (salt); the operator's
    fields add alice's (adapter)."""
    base = CacheNamespace(model="m", adapter="a", position_base=0, attention="causal",
                          kv_dtype="float32")
    trie = PrefixTrie(4, PageAllocator(8))
    tokens, digests = PROMPT[:4], history_digests(PROMPT[:4], 4)
    pages = trie.allocator.allocate(2)
    trie.insert(base, tokens, [None], digests, pages[:1])
    trie.insert(dataclasses.replace(base, adapter="b"), tokens, ["alice"], digests, pages[1:])
    bob = trie.match(base, tokens, ["bob"], digests)
    assert (bob.cause, bob.fields) == ("namespace", ["salt"])
    assert (bob.operator_cause, bob.operator_fields) == ("namespace", ["adapter", "salt"])
