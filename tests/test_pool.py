"""PagePool and the admission plan: reserve with eviction then preemption, grow with copy on
write, and a plan that commits or aborts as a unit (no reference is left behind)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import small_model

from kvjax import CacheConfig, KVPool, PagePool, Request
from kvjax.engine.requests import LiveRequest, context
from kvjax.engine.scheduler import plan_admission

CONFIG = small_model(max_seq_len=64)
CACHE = CacheConfig(page_size=4, num_pages=8, prefill_chunk=8)


def _live(pool: PagePool, tokens: list[int]) -> LiveRequest:
    request = Request(tokens=tokens)
    return LiveRequest(id=0, request=request, tokens=tokens, namespace=pool.namespace(0),
                       context=context(request, tokens, 4), adapter_index=0, submitted=0.0)


def _cached(pool: PagePool, tokens: list[int]) -> list[int]:
    """Caches `tokens`' full pages in the pool's trie (as a finished prompt would)."""
    req = _live(pool, tokens)
    pages = pool.allocator.allocate(len(tokens) // 4)
    pool.trie.insert(req.namespace, tokens, req.context.salts, req.context.digests, pages)
    pool.release(pages)  # the trie's reference stays
    return pages


def _refcounts(pool: PagePool) -> list[int]:
    return [pool.allocator.refcount(p) for p in range(CACHE.num_pages)]


@pytest.fixture
def pools():
    target, draft = PagePool(CONFIG, CACHE), PagePool(CONFIG, CACHE)
    target.fingerprint = draft.fingerprint = "test"
    return target, draft


def test_kvpool_is_the_page_pool():
    assert KVPool is PagePool


def test_a_plan_without_room_gives_back_every_reference(pools):
    target, draft = pools
    prompt = list(range(1, 9))  # two full pages
    reused = _cached(target, prompt)
    _cached(draft, prompt)
    running = target.allocator.allocate(target.allocator.num_free - 1)  # room for one
    req = _live(target, prompt + [20, 21, 22, 23, 24])  # 4 pages: 2 reused + 2 fresh
    before = (_refcounts(target), _refcounts(draft))
    assert plan_admission(req, target, draft, True, False) is None
    assert (_refcounts(target), _refcounts(draft)) == before
    target.release(running)
    plan = plan_admission(req, target, draft, True, False)
    assert plan is not None and plan.target.reused == reused and plan.start == 8
    assert [target.allocator.refcount(p) for p in reused] == [2, 2]  # held while planned
    plan.target.abort()
    plan.draft.abort()
    assert (_refcounts(target), _refcounts(draft)) == (
        [r if i not in running else 0 for i, r in enumerate(before[0])], before[1])


def test_a_draft_pool_without_room_aborts_the_whole_plan(pools):
    target, draft = pools
    prompt = list(range(1, 9))
    _cached(target, prompt)
    _cached(draft, prompt)  # the draft's plan holds these two pages while it counts room
    draft.allocator.allocate(draft.allocator.num_free)  # and has none for the third
    req = _live(target, prompt + [20, 21, 22])
    before = (_refcounts(target), _refcounts(draft))
    assert plan_admission(req, target, draft, True, False) is None
    assert (_refcounts(target), _refcounts(draft)) == before


def test_commit_allocates_and_write_copies_a_partial_page(pools):
    target, _ = pools
    prompt = list(range(1, 13))  # three full pages cached
    cached = _cached(target, prompt)
    target.cache = target.cache.replace(k=target.cache.k.at[:, :, cached[2]].set(7.0))
    req = _live(target, prompt[:10] + [30, 31])  # shares 2 pages, then 2 tokens of the 3rd
    plan = plan_admission(req, target, None, True, True)
    assert plan.target.copy_from == cached[2] and plan.target.copied == 2 and plan.start == 10
    pages = plan.target.commit()
    assert pages[:2] == cached[:2] and len(pages) == 3 and pages[2] not in cached
    assert target.allocator.refcount(cached[2]) == 2  # held until the copy is written
    plan.target.write(pages)
    np.testing.assert_array_equal(np.asarray(target.cache.k[:, :, pages[2]]), 7.0)
    assert target.allocator.refcount(cached[2]) == 1  # the copy source: the trie's only


def test_reserve_evicts_then_preempts_and_grow_copies_on_write(pools):
    target, _ = pools
    _cached(target, list(range(1, 9)))
    held = target.allocator.allocate(target.allocator.num_free)
    calls = []

    def preempt() -> bool:
        calls.append(1)
        if len(calls) > 1:
            return False
        target.release(held[:1])
        return True

    assert target.reserve(3, preempt)  # 2 evicted, then 1 from a preemption
    assert target.trie.num_nodes == 0 and len(calls) == 1
    assert not target.reserve(target.allocator.num_free + 1, preempt)  # nobody left
    shared = target.allocator.allocate(1)
    target.allocator.share(shared[0])
    pages = list(shared)
    assert target.grow(pages, 2, 6)  # writes slots 2..5: the shared page is copied
    assert pages[0] != shared[0] and len(pages) == 2
    assert target.allocator.refcount(shared[0]) == 1 and target.allocator.copies == 1


def test_commit_touches_every_matched_page_even_the_recomputed_last_one(pools):
    """A fully cached prompt recomputes its last page (for the logits) but still uses the
    cached one's history: LFU counts a hit on every matched page."""
    target, _ = pools
    prompt = list(range(1, 9))  # two full pages, both cached
    _cached(target, prompt)
    req = _live(target, prompt)
    plan = plan_admission(req, target, None, True, False)
    assert plan.reuse == 1 and len(plan.target.nodes) == 2
    plan.target.commit()
    assert [n.hits for n in plan.target.nodes] == [1, 1]
