"""Unit tests of the host prefix trie with its page allocator: matching, insertion, eviction
order per policy, miss causes and the evicted-block records. No engine, no device work.

Every scenario checks each page's reference count and the free count after each operation:
a page's count is the trie's one reference (while cached) plus the live sequences' own.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from kvjax.bench import trie as bench_trie
from kvjax.cache.allocator import PageAllocator, pages_for
from kvjax.cache.identity import CacheNamespace
from kvjax.cache.node import common_prefix
from kvjax.cache.trie import EVICTION_POLICIES, PrefixTrie, history_digests

PS = 4
NS = CacheNamespace(model="m", adapter="none", position_base=0, attention="causal",
                    kv_dtype="bfloat16")
OTHER = dataclasses.replace(NS, position_base=8)
LORA = dataclasses.replace(NS, adapter="lora@1")


def blk(k: int) -> list[int]:
    """Block k: a page of tokens no other block shares (first token 10 * k)."""
    return [10 * k + j for j in range(PS)]


def make(num_pages: int = 16, **kwargs) -> PrefixTrie:
    return PrefixTrie(PS, PageAllocator(num_pages), **kwargs)


def salts_for(tokens, salt) -> list[str | None]:
    """One salt per page (full or not); a list is taken as given."""
    return list(salt) if isinstance(salt, list) else [salt] * pages_for(len(tokens), PS)


def put(trie, tokens, salt=None, ns=NS, release=True) -> list[int]:
    """Prefills `tokens` into fresh pages and caches their full pages, as a finished prompt
    would; with `release`, the sequence then lets its own references go."""
    pages = trie.allocator.allocate(pages_for(len(tokens), PS))
    trie.insert(ns, tokens, salts_for(tokens, salt), history_digests(tokens, PS), pages)
    if release:
        trie.allocator.free(pages)
    return pages


def match(trie, tokens, salt=None, ns=NS, touch=False):
    return trie.match(ns, tokens, salts_for(tokens, salt), history_digests(tokens, PS),
                      touch=touch)


def check(trie, live=()):
    """Counts equal the trie's references plus `live` (pages sequences hold); the rest free."""
    alloc = trie.allocator
    expected = collections.Counter(trie.pages()) + collections.Counter(live)
    assert [alloc.refcount(p) for p in range(alloc.num_pages)] == [
        expected[p] for p in range(alloc.num_pages)]
    assert alloc.num_free == alloc.num_pages - len(expected)
    assert trie.num_nodes == len(trie.pages()) == len(set(trie.pages()))


def evict_order(trie, n: int, live=()) -> list[int]:
    """Evicts one page at a time and returns the pages in the order they were freed."""
    order = []
    for _ in range(n):
        before = set(trie.pages())
        assert trie.evict(1) == 1
        (page,) = before - set(trie.pages())
        order.append(page)
        check(trie, live)
    return order


def test_match_is_the_longest_prefix_of_full_pages():
    """Full pages match up to the first differing block; a tail shorter than a page never
    matches, and a full miss inside a cached block names the first differing position."""
    trie = make()
    a, b, c = put(trie, blk(1) + blk(2) + blk(3))
    check(trie)
    assert match(trie, blk(1) + blk(2) + blk(3)).pages == [a, b, c]
    hit = match(trie, blk(1) + blk(2) + blk(3) + [7, 7])
    assert (hit.pages, hit.cause) == ([a, b, c], None)
    div = match(trie, blk(1) + blk(2) + [30, 31, 0, 0])
    assert (div.pages, div.cause, div.position) == ([a, b], "divergence", 10)
    assert div.partial[0].page == c and div.partial[1] == 2
    first = match(trie, [10, 11, 99, 99])
    assert (first.pages, first.cause, first.position) == ([], "divergence", 2)
    part = match(trie, blk(1) + [20, 21])
    assert (part.pages, part.cause, part.position) == ([a], "partial_page", 6)
    assert (part.partial[0].page, part.partial[1]) == (b, 2)
    short = match(trie, [10, 11, 12])
    assert (short.pages, short.cause, short.position) == ([], "partial_page", 3)
    check(trie)


def test_a_tail_shorter_than_a_page_is_never_cached():
    trie = make()
    pages = put(trie, blk(1) + blk(2) + [30, 31], release=False)
    assert len(pages) == 3 and trie.num_nodes == 2
    check(trie, live=pages)
    assert trie.allocator.refcount(pages[2]) == 1
    assert match(trie, blk(1) + blk(2) + [30, 31]).pages == pages[:2]
    trie.allocator.free(pages)
    check(trie)


def test_tokens_are_compared_exactly_when_every_hash_collides():
    """With one bucket for everything, blocks that differ only in their last token, or only
    in their salt, stay apart; a short tail never matches the page it starts; eviction
    removes the very node it frees from the shared bucket."""
    trie = make(hash_fn=lambda salt, tokens: 0)
    near = [10, 11, 12, 99]
    a, b = put(trie, blk(1) + blk(2))
    n, c = put(trie, near + blk(3))
    s, d = put(trie, blk(1) + blk(4), salt="t1")
    check(trie)
    assert match(trie, blk(1) + blk(2)).pages == [a, b]
    assert match(trie, near + blk(3)).pages == [n, c]
    assert match(trie, blk(1) + blk(4), salt="t1").pages == [s, d]
    assert match(trie, blk(1) + blk(3)).pages == [a]
    miss = match(trie, [10, 11, 12, 98])
    assert (miss.pages, miss.cause, miss.position) == ([], "divergence", 3)
    assert match(trie, blk(1) + blk(2), salt="t2").pages == []
    tail = match(trie, [10, 11, 12])
    assert (tail.pages, tail.cause, tail.position) == ([], "partial_page", 3)
    trie.touch(match(trie, blk(1) + blk(2)).nodes)
    assert evict_order(trie, 6) == [c, n, d, s, b, a]
    assert trie.num_nodes == 0 and trie.allocator.num_free == 16


def test_insert_adds_new_blocks_only_and_keeps_the_first_page():
    """A block already cached keeps its page; the duplicate gets no trie reference and is
    freed when its sequence lets it go."""
    trie = make()
    first = put(trie, blk(1) + blk(2), release=False)
    check(trie, live=first)
    assert [trie.allocator.refcount(p) for p in first] == [2, 2]
    second = trie.allocator.allocate(3)
    tokens = blk(1) + blk(2) + blk(3)
    added = trie.insert(NS, tokens, [None] * 3, history_digests(tokens, PS), second)
    assert added == 1
    assert [trie.allocator.refcount(p) for p in second] == [1, 1, 2]
    check(trie, live=first + second)
    assert match(trie, tokens).pages == first + second[2:]
    trie.allocator.free(first + second)
    check(trie)
    assert trie.allocator.num_free == 16 - 3


def test_insert_caches_only_the_blocks_it_has_pages_for():
    """A prefill chunk's insert: the context's tokens, the pages written so far."""
    trie = make()
    tokens = blk(1) + blk(2) + blk(3)
    pages = trie.allocator.allocate(3)
    assert trie.insert(NS, tokens, [None] * 3, history_digests(tokens, PS), pages[:2]) == 2
    check(trie, live=pages)
    assert trie.insert(NS, tokens, [None] * 3, history_digests(tokens, PS), pages) == 1
    assert match(trie, tokens).pages == pages
    trie.allocator.free(pages)
    check(trie)


def test_eviction_takes_only_leaves_that_only_the_trie_holds():
    """Interior nodes wait for their children; a page a live sequence holds is never taken,
    nor is any node above it."""
    trie = make()
    a, b, c = put(trie, blk(1) + blk(2) + blk(3), release=False)
    trie.allocator.free([a, b])
    _, d = put(trie, blk(1) + blk(4))
    check(trie, live=[c])
    assert [n.page for n in trie.evictable()] == [d]
    assert trie.num_evictable() == 1
    assert trie.evict(10) == 1
    check(trie, live=[c])
    assert trie.pages() != [] and trie.evict(10) == 0
    assert trie.allocator.refcount(c) == 2
    trie.allocator.free([c])
    assert trie.num_evictable() == 3
    assert evict_order(trie, 3) == [c, b, a]
    assert trie.evict(1) == 0 and trie.allocator.num_free == 16


def test_num_evictable_counts_whole_free_subtrees():
    """A node counts when nothing in its subtree is held; the held page's ancestors never."""
    trie = make()
    a, b, c = put(trie, blk(1) + blk(2) + blk(3), release=False)
    trie.allocator.free([a, c])
    _, d = put(trie, blk(1) + blk(4))
    _, f = put(trie, blk(5) + blk(6))
    check(trie, live=[b])
    assert sorted(n.page for n in trie.evictable()) == sorted([c, d, f])
    assert trie.num_evictable() == 4
    assert trie.evict(10) == 4
    check(trie, live=[b])
    assert sorted(trie.pages()) == [a, b]
    assert trie.evictable() == [] and trie.num_evictable() == 0


def policy_scenario(policy: str) -> tuple[PrefixTrie, dict[str, int]]:
    """Four single-page leaves with (created, last_used, hits) after the steps below:
    A (1, 6, 1), B (2, 3, 1), C (4, 4, 0), D (5, 6, 1). Order of eviction:
    fifo A B C D; lru (last_used, created) B C A D; lfu (hits, last_used, created) C B A D.
    Each tie-breaker decides a pair: A before D on created, B before A on last_used."""
    trie = make(policy=policy)
    pages = {}
    (pages["A"],) = put(trie, blk(1))
    (pages["B"],) = put(trie, blk(2))
    trie.touch(match(trie, blk(2)).nodes)
    (pages["C"],) = put(trie, blk(3))
    (pages["D"],) = put(trie, blk(4))
    trie.touch(match(trie, blk(4)).nodes + match(trie, blk(1)).nodes)
    check(trie)
    return trie, pages


ORDERS = [("fifo", "ABCD"), ("lru", "BCAD"), ("lfu", "CBAD")]


@pytest.mark.parametrize(("policy", "order"), ORDERS)
def test_each_policy_evicts_in_its_own_order(policy, order):
    trie, pages = policy_scenario(policy)
    assert evict_order(trie, 4) == [pages[k] for k in order]


@pytest.mark.parametrize(("policy", "order"), ORDERS)
def test_the_first_victim_is_skipped_while_a_sequence_holds_it(policy, order):
    trie, pages = policy_scenario(policy)
    trie.allocator.share(pages[order[0]])
    held = [pages[order[0]]]
    assert evict_order(trie, 3, live=held) == [pages[k] for k in order[1:]]
    assert trie.evict(1) == 0
    check(trie, live=held)


def test_a_match_without_touch_leaves_the_order_alone():
    """The scheduler matches with touch=False while it plans; only a commit touches."""
    trie, pages = policy_scenario("lru")
    match(trie, blk(2), touch=False)
    assert evict_order(trie, 1) == [pages["B"]]
    match(trie, blk(3), touch=True)
    assert evict_order(trie, 2) == [pages["A"], pages["D"]]


def test_a_key_registered_in_eviction_policies_orders_eviction(monkeypatch):
    """The custom key of docs/engine.md: any function registered in EVICTION_POLICIES by name."""
    monkeypatch.setitem(EVICTION_POLICIES, "mru", lambda n: (-n.last_used, -n.created))
    trie, pages = policy_scenario("mru")
    assert evict_order(trie, 4) == [pages[k] for k in "DACB"]
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'.*mru"):
        make(policy="nope")


def test_another_namespace_field_or_salt_is_not_matched():
    trie = make()
    put(trie, blk(1) + blk(2))
    for ns, fields in [(NS.with_salt("t1"), ["salt"]),
                       (LORA, ["adapter"]),
                       (dataclasses.replace(OTHER, model="m2"), ["model", "position_base"])]:
        miss = trie.match(ns.with_salt(None), blk(1) + blk(2), [ns.salt] * 2,
                          history_digests(blk(1) + blk(2), PS))
        assert (miss.pages, miss.cause, miss.fields) == ([], "namespace", fields)
        assert miss.hidden_fields is None and miss.operator_cause == "namespace"
    check(trie)


def test_cold_and_capacity_causes():
    """Never seen is cold; a block evicted from the very same path is capacity."""
    trie = make()
    assert (match(trie, blk(1)).cause, match(trie, blk(1)).pages) == ("cold", [])
    a, _ = put(trie, blk(1) + blk(2))
    assert match(trie, blk(5) + blk(2)).cause == "cold"
    assert match(trie, blk(1) + blk(2)).cause is None
    assert trie.evict(1) == 1
    check(trie)
    miss = match(trie, blk(1) + blk(2))
    assert (miss.pages, miss.cause) == ([a], "capacity")
    assert match(trie, blk(2)).cause == "cold"
    assert trie.evict(1) == 1 and match(trie, blk(1) + blk(2)).cause == "capacity"
    assert trie.evictions == 2
    check(trie)


def test_a_tenants_private_blocks_are_hidden_from_another_tenant():
    """Tenant t1's salted pages do not exist for t2 or a public request (cold), but the
    operator's view names the salt; a public copy is visible to everyone."""
    trie = make()
    tokens = blk(1) + blk(2)
    put(trie, tokens, salt="t1")
    for salt in ["t2", None]:
        miss = match(trie, tokens, salt=salt)
        assert (miss.pages, miss.cause, miss.fields) == ([], "cold", [])
        assert miss.hidden_fields == ["salt"]
        assert (miss.operator_cause, miss.operator_fields) == ("namespace", ["salt"])
    own = trie.match(NS.with_salt(None), tokens, ["t1"] * 2, history_digests(tokens, PS))
    assert own.cause is None
    mine = trie.match(LORA, tokens, ["t1"] * 2, history_digests(tokens, PS))
    assert (mine.cause, mine.fields, mine.hidden_fields) == ("namespace", ["adapter"], None)
    theirs = trie.match(LORA, tokens, ["t2"] * 2, history_digests(tokens, PS))
    assert (theirs.cause, theirs.hidden_fields) == ("cold", ["adapter", "salt"])
    put(trie, tokens)
    seen = match(trie, tokens, salt="t2")
    assert (seen.cause, seen.fields, seen.hidden_fields) == ("namespace", ["salt"], ["salt"])
    check(trie)


def test_a_public_prefix_is_shared_and_the_private_rest_is_not():
    trie = make()
    tokens = blk(1) + blk(2)
    p, _ = put(trie, tokens, salt=[None, "t1"])
    miss = match(trie, tokens, salt=[None, "t2"])
    assert (miss.pages, miss.cause, miss.hidden_fields) == ([p], "cold", ["salt"])
    check(trie)


def test_re_insertion_clears_the_evicted_record():
    """A block cached again and evicted again is the newest record, so it outlives a block
    evicted in between (with room for two records)."""
    trie = make(evicted_record=2)
    first = put(trie, blk(1))
    put(trie, blk(2))
    assert evict_order(trie, 1) == first
    put(trie, blk(1))
    assert match(trie, blk(1)).cause is None
    assert trie.evict(2) == 2
    put(trie, blk(3))
    assert trie.evict(1) == 1
    assert [match(trie, blk(k)).cause for k in (1, 2, 3)] == ["capacity", "cold", "capacity"]
    check(trie)


def test_the_evicted_record_drops_its_oldest_first():
    trie = make(policy="fifo", evicted_record=2)
    for k in (1, 2, 3):
        put(trie, blk(k))
    assert trie.evict(3) == 3
    assert [match(trie, blk(k)).cause for k in (1, 2, 3)] == ["cold", "capacity", "capacity"]
    assert trie.unbounded_blocks(NS, blk(1), [None]) == 1
    check(trie)


def test_unbounded_blocks_counts_every_block_ever_cached_on_the_path():
    trie = make()
    tokens = blk(1) + blk(2) + blk(3)
    put(trie, tokens[:8])
    put(trie, blk(1) + blk(4), salt="t1")
    assert trie.evict(10) == 4 and trie.num_nodes == 0
    assert trie.unbounded_blocks(NS, tokens, [None] * 3) == 2
    assert trie.unbounded_blocks(NS, tokens[:6], [None] * 2) == 1
    assert trie.unbounded_blocks(NS, blk(1) + blk(4), ["t1"] * 2) == 2
    assert trie.unbounded_blocks(NS, blk(1) + blk(4), [None] * 2) == 1
    assert trie.unbounded_blocks(NS.with_salt("t1"), blk(1), ["t2"]) == 0
    assert trie.unbounded_blocks(OTHER, tokens, [None] * 3) == 0
    check(trie)


def test_clear_returns_every_reference():
    trie = make()
    held = put(trie, blk(1) + blk(2) + blk(3), release=False)
    put(trie, blk(1) + blk(4) + blk(5))
    put(trie, blk(6), salt="t1")
    put(trie, blk(6), ns=OTHER)
    check(trie, live=held)
    assert trie.num_nodes == 7
    trie.clear()
    assert trie.num_nodes == 0 and trie.pages() == []
    check(trie, live=held)
    assert trie.allocator.num_free == 16 - 3
    assert match(trie, blk(1)).cause == "capacity"


def scanned_closest(node, tokens):
    """Node.closest by scanning every child: (any child, (child, shared) or None)."""
    kids = node.child_list()
    best = max(((c, common_prefix(c.tokens, tokens)) for c in kids), key=lambda x: x[1],
               default=None)
    return bool(kids), (best if best and best[1] > 0 else None)


def path(rng) -> list[int]:
    """1-4 pages, each one of three blocks at its depth (histories share prefixes often)."""
    return [t for i, b in enumerate(rng.integers(1, 4, rng.integers(1, 5)))
            for t in blk(int(b) * 7 + i)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_eviction_state_follows_every_reference_change(policy):
    """Random inserts, matches, shares, releases and evictions (sequences that hold their
    path, and ones that prefilled a cached prefix again, so they hold pages below an
    ancestor they do not hold): after every step the kept count equals a walk of the
    trie, and each evicted page was a leaf only the trie held with the smallest key."""
    rng = np.random.default_rng(7)
    trie = make(64, policy=policy)
    live: list[list[int]] = []  # each sequence's own references
    for _ in range(600):
        op = rng.integers(0, 4)
        if op == 0 and trie.allocator.num_free >= 4:  # prefill and cache a prompt
            tokens = path(rng)
            live.append(put(trie, tokens, release=False))
        elif op == 1 and live:  # a sequence finishes
            trie.allocator.free(live.pop(int(rng.integers(len(live)))))
        elif op == 2:  # a request matches and holds the cached prefix it found
            tokens = path(rng)
            found = match(trie, tokens, touch=True)
            for page in found.pages:
                trie.allocator.share(page)
            live.append(list(found.pages))
        else:  # evict one page
            leaves = trie.evictable()
            best = min((trie.priority(n) for n in leaves), default=None)
            before = {n.page: n for n in leaves}
            assert trie.evict(1) == (1 if leaves else 0)
            gone = set(before) - set(trie.pages())
            if leaves:
                (page,) = gone
                assert trie.priority(before[page]) == best
        assert trie.num_evictable() == trie.walk_evictable()
        check(trie, live=[p for seq in live for p in seq])
        node = trie._roots.get(NS)
        while node is not None:  # miss causes from the index == a scan of every child
            kids = node.child_list()
            if not kids:
                break
            base = kids[int(rng.integers(len(kids)))].tokens  # a child's block, cut and bent
            cut = int(rng.integers(1, PS + 1))
            probe = (*base[:cut - 1], base[cut - 1] + int(rng.integers(0, 2)))
            assert node.closest(None, probe) == scanned_closest(node, probe)
            assert node.closest("t1", probe) == (False, None)
            node = kids[int(rng.integers(len(kids)))]


def test_a_key_that_changes_behind_the_tries_back_loses_no_page(monkeypatch):
    """A custom key may read state the trie does not see change: an entry whose key went
    stale is put back at its current key, so every evictable page can still be evicted."""
    rank = collections.defaultdict(int)
    monkeypatch.setitem(EVICTION_POLICIES, "ranked", lambda n: (rank[n.page],))
    trie = make(policy="ranked")
    pages = [put(trie, blk(k))[0] for k in (1, 2, 3)]
    rank.update({p: 3 - i for i, p in enumerate(pages)})  # every pushed key is now stale
    assert trie.evict(3) == 3 and trie.num_nodes == 0
    check(trie)


def test_the_admission_benchmark_runs_and_its_kept_count_equals_a_walk():
    """`kvjax bench trie` at a toy size: a full pool whose every page is cached, each
    admission evicts for its new pages, and the kept evictable count equals a walk."""
    row = bench_trie.measure(400, 10)
    assert 400 - bench_trie.PROMPT_PAGES < row["cached_pages"] <= 400
    assert row["evictions"] >= 10 * (bench_trie.PROMPT_PAGES // 2 + bench_trie.PROMPT_PAGES - 4)
    assert row["admission_ms"] > 0 and row["new_conversation_ms"] > 0 and row["walk_ms"] > 0
