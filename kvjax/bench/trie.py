"""Host time of a prefix-cache admission against the number of cached pages (no model).

A synthetic trie of N cached pages (conversations under one system prompt, every page
released, so all are evictable) in a pool with no free pages: each admission matches a
prompt whose first half is cached, makes room for the rest (eviction), holds its pages,
caches the new ones and releases them, as the engine does for a request; and a new
conversation, which shares only the system prompt with the cache (its miss cause is found
among every conversation cached under that prompt). Reported: the median host time per
admission of each kind, and one walk of the whole trie (what the room check cost
when it counted evictable pages by walking: `PrefixTrie.walk_evictable`, which the tests
also check the kept count against).
"""

from __future__ import annotations

import time

import numpy as np

from kvjax.cache.allocator import PageAllocator, pages_for
from kvjax.cache.identity import CacheNamespace
from kvjax.cache.trie import PrefixTrie, history_digests
from kvjax.lab.progress import Progress
from kvjax.lab.report import emit, markdown_table, write_results

PAGE = 16
PROMPT_PAGES = 32  # an admitted prompt: 16 cached pages, 16 new ones
NS = CacheNamespace(model="bench", adapter="none", position_base=0, attention="causal",
                    kv_dtype="float32")


def _cache(trie: PrefixTrie, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """Admits `tokens` as the engine does: match (touch), hold the matched pages, make room
    for the rest, cache every full page, release. Returns the pages it held."""
    salts = [None] * pages_for(len(tokens), PAGE)
    digests = history_digests(tokens, PAGE)
    found = trie.match(NS, tokens, salts, digests)
    for page in found.pages:
        alloc.share(page)
    need = pages_for(len(tokens), PAGE) - len(found.pages)
    if alloc.num_free + trie.num_evictable() < need:
        raise RuntimeError("the bench trie has no room")
    trie.evict(need - alloc.num_free)
    pages = list(found.pages) + alloc.allocate(need)
    trie.insert(NS, tokens, salts, digests, pages)
    alloc.free(pages)
    return pages


def _prompt(rng, system: list[int], pages: int) -> list[int]:
    return system + [int(t) for t in rng.integers(0, 50_000, (pages - 4) * PAGE)]


def build(num_pages: int, seed: int = 0
          ) -> tuple[PrefixTrie, PageAllocator, list[list[int]]]:
    """A full pool of `num_pages` pages, every one cached and evictable: a 4-page system
    prompt and conversations of PROMPT_PAGES pages under it. Returns (trie, its allocator,
    prompts)."""
    rng = np.random.default_rng(seed)
    alloc = PageAllocator(num_pages)
    trie = PrefixTrie(PAGE, alloc)
    system = [int(t) for t in rng.integers(0, 50_000, 4 * PAGE)]
    prompts = []
    with Progress(num_pages, f"trie of {num_pages:,} pages") as bar:
        while trie.num_nodes + PROMPT_PAGES - 4 <= num_pages:
            prompts.append(_prompt(rng, system, PROMPT_PAGES))
            before = trie.num_nodes
            _cache(trie, alloc, prompts[-1])
            bar.update(trie.num_nodes - before)
    return trie, alloc, prompts


def walk_evictable(trie: PrefixTrie) -> int:
    """Deprecated: `PrefixTrie.walk_evictable`."""
    return trie.walk_evictable()


def measure(num_pages: int, admissions: int, seed: int = 0) -> dict:
    trie, alloc, prompts = build(num_pages, seed)
    rng = np.random.default_rng(seed + 1)
    system = prompts[0][: 4 * PAGE]
    times = {"continued": [], "new": []}
    for _ in range(admissions):
        half = prompts[int(rng.integers(len(prompts)))][: PROMPT_PAGES // 2 * PAGE]
        continued = half + [int(t) for t in rng.integers(0, 50_000, PROMPT_PAGES // 2 * PAGE)]
        for kind, tokens in (("continued", continued),
                             ("new", _prompt(rng, system, PROMPT_PAGES))):
            t0 = time.perf_counter()
            _cache(trie, alloc, tokens)
            times[kind].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    walked = trie.walk_evictable()
    walk_s = time.perf_counter() - t0
    if walked != trie.num_evictable():
        raise AssertionError(f"kept count {trie.num_evictable()} != walked {walked}")
    ms = {kind: 1e3 * np.asarray(t) for kind, t in times.items()}
    return {"cached_pages": trie.num_nodes, "admissions": admissions,
            "admission_ms": float(np.median(ms["continued"])),
            "admission_p90_ms": float(np.percentile(ms["continued"], 90)),
            "new_conversation_ms": float(np.median(ms["new"])),
            "new_conversation_p90_ms": float(np.percentile(ms["new"], 90)),
            "walk_ms": 1e3 * walk_s, "evictions": trie.evictions}


COLUMNS = [
    ("cached pages", lambda r: f"{r['cached_pages']:,}"),
    ("continued conversation, median (p90) ms",
     lambda r: f"{r['admission_ms']:.3f} ({r['admission_p90_ms']:.3f})"),
    ("new conversation, median (p90) ms",
     lambda r: f"{r['new_conversation_ms']:.3f} ({r['new_conversation_p90_ms']:.3f})"),
    ("one walk of the trie (ms)", lambda r: f"{r['walk_ms']:.1f}"),
]


def main(args) -> int:
    sizes = [int(x) for x in args.pages.split(",")]
    emit(f"bench trie: page {PAGE} tokens, prompts of {PROMPT_PAGES} pages (half cached), "
         f"{args.admissions} admissions of each kind per size, every page cached and "
         f"evictable")
    rows = [measure(n, args.admissions) for n in sizes]
    write_results(args.out, markdown_table(rows, COLUMNS), rows, args=vars(args) | {"func": None})
    return 0
