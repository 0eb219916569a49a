"""PagePool: one model's paged KV cache and the host structures that hand out its pages.

A pool is the device cache (a donated pytree), the allocator (reference-counted pages), the
prefix trie (finished full pages kept for reuse) and the fixed fields of the namespace its
entries live under. The engine's `KVCacheManager` (`kvjax.cache.manager`) holds one for the
target model and one for the draft model; `generate()` and the host speculative loop hold
one (`KVPool`, the same class) and use its pages and cache only. Every page operation is
written once, here, and only code in `kvjax.cache` touches a pool's allocator, trie or
cache (`tests/test_layout.py`): allocate, share, reserve (evicting cached leaves, then asking
the caller to preempt), grow (copy on write), truncate, release, poison, insert and match;
`run` is the one place a device step's new cache is stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.cache.allocator import PageAllocator, free_past, pages_for
from kvjax.cache.identity import CacheNamespace, attention_signature
from kvjax.cache.node import Node, child_key
from kvjax.cache.paged import (
    PagedKVCache,
    bytes_per_page,
    copy_pages,
    init_cache,
    padded_ids,
    page_layout,
    poison_pages,
    read_pages,
    write_pages,
)
from kvjax.cache.tier_block import TierBlock, checksum
from kvjax.cache.tiers import Tiers
from kvjax.cache.trie import EVICTION_POLICIES, Match, PrefixTrie
from kvjax.config import CacheConfig, ConfigError, ModelConfig
from kvjax.errors import NonCausalCacheError

Preempt = Callable[[], bool]  # frees some pages by preempting a request; False: none left


class PagePool:
    """A device page pool with its allocator, prefix trie and namespace (module docstring).

    `sharding` (a `kvjax.sharding.ShardingPlan`) places the cache on a mesh; `poison_freed`
    fills free pages with NaN on device (a debug mode: a read of a freed page shows);
    `open_rows`: int4_kivi pages' open pages, one per slot (`kvjax.cache.kivi`).
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, *, eviction: str = "lru",
                 evicted_record: int = 65536, hash_fn=None, poison_freed: bool = False,
                 sharding=None, open_rows: int = 0):
        if not model.causal:
            raise NonCausalCacheError()
        if eviction not in EVICTION_POLICIES:
            raise ConfigError("engine.eviction", f"{eviction!r} is not one of "
                              f"{', '.join(map(repr, EVICTION_POLICIES))}")
        if sharding is not None and (cache.host_bytes or cache.disk_dir is not None):
            raise NotImplementedError("host and disk tiers on a device mesh: their page "
                                      "reads and writes have no sharding rule yet")
        self.model_config = model
        self.cache_config = cache
        self.sharding = sharding
        self.cache: PagedKVCache = (init_cache(model, cache, open_rows) if sharding is None
                                    else sharding.init_cache(cache))
        self.allocator = PageAllocator(cache.num_pages, track_freed=poison_freed)
        self.trie = PrefixTrie(cache.page_size, self.allocator, eviction,
                               evicted_record=evicted_record,
                               **({} if hash_fn is None else {"hash_fn": hash_fn}))
        self.fingerprint: str | None = None  # the weights' (set by whoever loads them)
        # tokens past slot j that slot j's state depends on: 0 for a model's K/V, 1 for an
        # EAGLE head's pair [F_j, e(h_{j+1})] (its trie keys: `admission.pool_keys`)
        self.lead = 0
        # Host and disk tiers for evicted pages (kvjax.cache.tiers): the trie hands over
        # what each eviction dropped while the pages still hold it (`_spill`).
        self.tiers = Tiers.for_cache(cache, page_layout(self.cache))
        self._buffers: dict[int, dict[str, np.ndarray]] = {}  # restores' staging buffers
        if self.tiers is not None:
            self.trie.on_evict = self._spill
        if poison_freed:
            self.cache = poison_pages(self.cache, np.arange(cache.num_pages, dtype=np.int32))

    @classmethod
    def for_engine(cls, model: ModelConfig, engine_config, hash_fn=None,
                   sharding=None, tiers: bool = True) -> PagePool:
        """A pool with an `EngineConfig`'s cache, eviction and debug settings (without its
        host and disk tiers unless `tiers`)."""
        ec = engine_config
        cache = ec.cache if tiers else dataclasses.replace(ec.cache, host_bytes=0,
                                                            disk_dir=None, disk_bytes=0)
        return cls(model, cache, eviction=ec.eviction, evicted_record=ec.evicted_record,
                   hash_fn=hash_fn, poison_freed=ec.poison_freed, sharding=sharding,
                   open_rows=ec.max_slots)

    def namespace(self, position_base: int, adapter: str = "none") -> CacheNamespace:
        """The namespace (without salt) of a history computed by this pool's model."""
        return CacheNamespace(model=self.fingerprint, adapter=adapter,
                              position_base=position_base,
                              attention=attention_signature(self.model_config),
                              kv_dtype=self.cache_config.dtype)

    @property
    def page_size(self) -> int:
        return self.cache_config.page_size

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def room(self) -> int:
        """Pages that can be had without preempting anyone: free ones and evictable ones."""
        return self.allocator.num_free + self.trie.num_evictable()

    @property
    def page_bytes(self) -> int:
        return bytes_per_page(self.cache)

    def run(self, step: Callable[[PagedKVCache], tuple[Any, PagedKVCache]]) -> Any:
        """Runs a device step on the cache: `step(cache)` returns (result, new cache); the
        pool keeps the new cache (the old one was donated) and returns the result."""
        result, self.cache = step(self.cache)
        return result

    def allocate(self, num_pages: int) -> list[int]:
        """`num_pages` free pages (each with one reference); raises when too few are free."""
        return self.allocator.allocate(num_pages)

    def share(self, pages: list[int]) -> None:
        """One more reference on each page (another sample reads them; copy on write)."""
        for page in pages:
            self.allocator.share(page)

    def insert(self, namespace: CacheNamespace, tokens: list[int], salts, digests,
               pages: list[int]) -> None:
        """The full pages of `tokens` held in `pages` enter the trie under `namespace`."""
        self.trie.insert(namespace, tokens, salts, digests, pages)

    def match(self, namespace: CacheNamespace, tokens: list[int], salts, digests) -> Match:
        """The longest cached prefix of `tokens` under `namespace` (nothing touched)."""
        return self.trie.match(namespace, tokens, salts, digests, touch=False)

    def unbounded_blocks(self, namespace: CacheNamespace, tokens: list[int], salts) -> int:
        """How many full pages of `tokens` an unbounded cache would hold now."""
        return self.trie.unbounded_blocks(namespace, tokens, salts)

    def reserve(self, num_pages: int, preempt: Preempt | None = None) -> bool:
        """Makes `num_pages` pages free: evicts cached leaves, then calls `preempt` (when
        given) until it frees enough or reports there is nobody left to preempt."""
        while self.allocator.num_free < num_pages:
            if self.trie.evict(num_pages - self.allocator.num_free):
                continue
            if preempt is None or not preempt():
                return False
        return True

    def evict(self, num_pages: int) -> int:
        """Evicts up to `num_pages` cached pages now (into the tiers, when the pool has
        them); returns how many went. Benchmarks and tests use it; admissions evict as they
        need room (`reserve`)."""
        return self.trie.evict(num_pages)

    # -- lower tiers ---------------------------------------------------------------------------
    def _spill(self, nodes: list[Node]) -> None:
        """The trie evicted `nodes`: their pages go to the tiers, except blocks a tier holds
        already (as after a restore)."""
        self.tiers.spill(self._blocks([n for n in nodes if not self.tiers.has(_key(n))]))

    def _blocks(self, nodes: list[Node]) -> list[TierBlock]:
        """The blocks of `nodes`' pages, with their histories (one device read)."""
        if not nodes:
            return []
        ids = padded_ids([node.page for node in nodes], self.cache_config.num_pages)
        read = {name: np.asarray(a) for name, a in read_pages(self.cache, ids).items()}
        blocks = []
        for i, node in enumerate(nodes):
            tokens, salts, n = [], [], node
            while n.parent is not None:
                tokens[:0] = n.tokens
                salts.insert(0, n.salt)
                n = n.parent
            arrays = {name: a[i].copy() for name, a in read.items()}
            blocks.append(TierBlock(*_key(node), tuple(tokens), tuple(salts), arrays,
                                    checksum(arrays)))
        return blocks

    def persist(self, chunk: int = 64) -> int:
        """Writes every page the trie and the host tier hold to the disk tier, so that the
        next process on the same folder finds this one's cache (what a process calls
        before it ends; host memory and the device go with it). Host blocks go first, then
        the trie's pages least recently used first, deepest first among equals (read from
        the device `chunk` at a time), so that past the disk's bound the most recently used
        stay. Pages the disk holds already are not written again. Returns the pages
        written."""
        disk = None if self.tiers is None else self.tiers.disk
        if disk is None:
            raise ConfigError("cache.disk_dir", "persisting the cache needs a disk tier")
        before = disk.stats["stored_pages"]
        self.tiers.persist_host()
        # a path's blocks share their last use: the deepest first, so a bound drops a
        # block before its parent (a block without its parent is never reached)
        nodes = sorted(self.trie.nodes(), key=lambda n: (n.last_used, -_depth(n)))
        for i in range(0, len(nodes), chunk):
            part = nodes[i:i + chunk]
            blocks = {(b.root, b.key): b
                      for b in self._blocks([n for n in part if not disk.holds(_key(n))])}
            for node in part:  # in order: a page filed already is marked used in its turn
                if not disk.has(_key(node)) and _key(node) in blocks:
                    disk.put(blocks[_key(node)])
        return disk.stats["stored_pages"] - before

    def _staging(self, n: int, page: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host buffers for `n` pages shaped like `page`, kept for the next restore of that
        many (a fresh buffer of tens of megabytes costs page faults each time). The write
        of padded rows is dropped, so what they hold does not matter."""
        if n not in self._buffers:
            self._buffers = {n: {name: np.empty((n, *a.shape), a.dtype)
                                 for name, a in page.items()}}
        return self._buffers[n]

    def restore(self, namespace: CacheNamespace, tokens: list[int], salts, digests,
                limit: int) -> None:
        """Brings the pages of `tokens` (at most its first `limit` full pages) that a lower
        tier holds, continuing what the trie holds, back into fresh device pages and the
        trie, as long as there is room without preempting. Each restored node remembers its
        tier (`Node.restored_from`) until an admission reuses it."""
        if self.tiers is None:
            return
        t0 = time.perf_counter()
        ps = self.page_size
        found = self.trie.match(namespace, tokens, salts, digests, touch=False)
        key = found.nodes[-1].key if found.nodes else b""
        root = namespace.with_salt(None)
        hits: list[tuple[TierBlock, str]] = []
        self.share(found.pages)  # the matched pages stay while room is made
        try:
            for i in range(len(found.nodes), limit):
                if len(hits) >= self.room:
                    break
                key = child_key(key, salts[i], tuple(tokens[i * ps:(i + 1) * ps]))
                hit = self.tiers.find((root, key), tokens[:(i + 1) * ps], salts[:i + 1])
                if hit is None:
                    break
                hits.append(hit)
            if not hits:
                return
            self.reserve(len(hits))
            fresh = self.allocate(len(hits))
            arrays = self._staging(len(padded_ids(fresh, 0)), hits[0][0].arrays)
            for j, (block, _) in enumerate(hits):
                for name, a in arrays.items():
                    a[j] = block.arrays[name]
            self.cache = write_pages(self.cache, padded_ids(fresh, self.cache_config.num_pages),
                                     arrays)
            self.cache.k.block_until_ready()  # restore_s counts the device write too
            end = (len(found.nodes) + len(hits)) * ps
            self.trie.insert(namespace, tokens[:end], salts, digests, found.pages + fresh)
            self.release(fresh)  # the trie holds them now
            node = self.trie.match(namespace, tokens[:end], salts, digests, touch=False)
            for restored, (_, tier) in zip(node.nodes[len(found.nodes):], hits, strict=True):
                restored.restored_from = tier
        finally:
            self.release(found.pages)
            self.tiers.restore_s += time.perf_counter() - t0

    def grow(self, pages: list[int], write_from: int, end: int,
             preempt: Preempt | None = None, host_timer=contextlib.nullcontext) -> bool:
        """Extends `pages` (in place) to cover cache slots [0, end), of which
        [write_from, end) may be written: shared pages in that range are copied first
        (copy on write). False, changing nothing, when the pages cannot be had.
        `host_timer()` is entered around the host work (reserve, with any preemption)."""
        ps = self.cache_config.page_size
        end = pages_for(end, ps)
        shared = [i for i in range(write_from // ps, min(end, len(pages)))
                  if self.allocator.refcount(pages[i]) > 1]
        need = max(end - len(pages), 0)
        with host_timer():
            ok = self.reserve(need + len(shared), preempt)
        if not ok:
            return False
        pages += self.allocator.allocate(need)
        for i in shared:
            fresh = self.allocator.copy_on_write(pages[i])
            self.flush_poison()
            self.copy_page(pages[i], fresh)
            pages[i] = fresh
        return True

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page `src` into page `dst` on device."""
        self.cache = copy_pages(self.cache, padded_ids([src], 0),
                                padded_ids([dst], self.cache_config.num_pages))

    def truncate(self, pages: list[int], length: int) -> None:
        """Rollback: releases the pages (in place) wholly past the first `length` slots."""
        free_past(self.allocator, pages, length, self.cache_config.page_size)

    def release(self, pages: list[int]) -> None:
        """Drops one reference on each page (a page with none left is free again)."""
        if pages:
            self.allocator.free(pages)

    def stats(self) -> dict:
        """What the engine's metrics read of the pool: resident (cached) pages, evictions,
        copy-on-write copies, free pages; with lower tiers, theirs (`Tiers.stats`)."""
        out = {"resident_pages": self.trie.num_nodes, "evictions": self.trie.evictions,
               "cow_copies": self.allocator.copies, "free_pages": self.allocator.num_free}
        if self.tiers is not None:
            out["tiers"] = self.tiers.stats()
        return out

    def flush_poison(self) -> None:
        """Poisons the pages freed since the last call that are still free (debug mode)."""
        if self.allocator.freed:
            freed = [p for p in self.allocator.freed if self.allocator.refcount(p) == 0]
            self.allocator.freed.clear()
            if freed:
                self.cache = poison_pages(self.cache,
                                          padded_ids(freed, self.cache_config.num_pages))


def _key(node: Node) -> tuple[CacheNamespace, bytes]:
    """A cached block's key in the tiers: (root namespace, path key)."""
    return node.namespace.with_salt(None), node.key


def _depth(node: Node) -> int:
    depth = 0
    while node.parent is not None:
        node, depth = node.parent, depth + 1
    return depth


KVPool = PagePool  # the name `generate()` users know
