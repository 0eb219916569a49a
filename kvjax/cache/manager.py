"""KVCacheManager: the engine's pages and device caches, in request terms.

It owns the target model's pool and, with a draft model, the draft's: the draft is one more
group of pages behind the same verbs (its K/V have the draft's shapes; its own allocator and
trie, under the draft's namespace, which has no adapter). It is the only code that assigns a
pool's device cache, allocates, shares, inserts into or evicts from a trie
(`tests/test_layout.py` checks that no module outside `kvjax.cache` does); the rounds, the
step runner and the speculative plug-in call its verbs:

  match(req)                 the target's longest cached prefix (nothing touched or held)
  admit(req)                 an `Admission` (pages held per pool, reused tokens, the match
                             with its miss cause), or None when a pool has no room yet
  grow(seq, tokens)          pages for a sample's next tokens (copy on write), evicting,
                             then preempting through the caller
  share(pages, draft_pages)  another sample reads the prompt's pages
  commit(req, tokens, ...)   the full pages of what prefill, decode or verification wrote
                             enter the tries
  rollback(seq)              a sample's pages wholly past its kept history go back
  release(pages, ...)        a sample's or a dropped prefill's pages go back
  run(step) / run_both(step) a device step over the target's cache (or both caches)

A request is what the engine holds (`kvjax.engine.requests.LiveRequest`): its `namespace`,
`context` (tokens, salts per page, digests) and `request.position_base`; a sample
(`kvjax.engine.requests.Seq`) has its `pages` and `length` in the target's pool and its
`draft_pages` and `draft_length` in the draft's. Preemption itself is the rounds' choice
(whom to preempt); the manager frees what it is told to. Host code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from kvjax.cache.admission import Admission, match, plan_admission, pool_keys
from kvjax.cache.paged import PagedKVCache
from kvjax.cache.pool import PagePool, Preempt
from kvjax.cache.trie import Match
from kvjax.config import EngineConfig, ModelConfig


class KVCacheManager:
    """The target's pool and the draft's (None without a draft model); see the module
    docstring for the verbs."""

    def __init__(self, target: PagePool, draft: PagePool | None = None, *,
                 prefix_cache: bool = True, partial_page_copy: bool = False):
        self.target = target
        self.draft = draft
        self.prefix_cache = prefix_cache
        self.partial_page_copy = partial_page_copy

    @classmethod
    def for_engine(cls, config: ModelConfig, engine_config: EngineConfig, hash_fn=None,
                   sharding=None, draft_config: ModelConfig | None = None,
                   draft_sharding=None) -> KVCacheManager:
        """The pools of an engine: the target's, and the draft model's when there is one,
        each with the engine's cache, eviction and debug settings."""
        ec = engine_config
        target = PagePool.for_engine(config, ec, hash_fn, sharding)
        draft = (None if draft_config is None
                 else PagePool.for_engine(draft_config, ec, hash_fn, draft_sharding,
                                          tiers=False))  # a draft recomputes its pages
        return cls(target, draft, prefix_cache=ec.prefix_cache,
                   partial_page_copy=ec.partial_page_copy)

    @property
    def pools(self) -> list[PagePool]:
        return [self.target] + ([] if self.draft is None else [self.draft])

    @property
    def page_size(self) -> int:
        return self.target.page_size

    # -- admission -----------------------------------------------------------------------------
    def match(self, req) -> Match:
        """The target's longest cached prefix of the request's context."""
        return match(self.target, req, self.prefix_cache)

    def admit(self, req) -> Admission | None:
        """The request's admission with every reused page held, or None (nothing held).
        Pages of the context that a lower tier of the target's pool holds are restored
        first (`PagePool.restore`), so the plan reuses them like any cached page."""
        if self.prefix_cache and self.target.tiers is not None:
            ctx = req.context
            limit = (len(ctx.tokens) - 1) // self.page_size
            if self.draft is not None and self.draft.lead:  # an EAGLE head's: the target
                # reuses no more pages than the head holds (its pages have no tiers)
                limit = min(limit, len(match(self.draft, req, True, draft=True).nodes))
            self.target.restore(req.namespace, ctx.tokens, ctx.salts, ctx.digests, limit)
        return plan_admission(req, self.target, self.draft, self.prefix_cache,
                              self.partial_page_copy)

    # -- pages ---------------------------------------------------------------------------------
    def grow(self, seq, tokens: int, preempt: Preempt | None = None,
             host_timer=contextlib.nullcontext) -> bool:
        """Gives the sample pages it may write for its next `tokens` cache slots, in both
        pools (in place; shared pages it will write are copied first, `PagePool.grow`);
        False when they cannot be had."""
        end = seq.length + tokens
        ok = self.target.grow(seq.pages, seq.length, end, preempt, host_timer)
        if ok and self.draft is not None:
            ok = self.draft.grow(seq.draft_pages, seq.draft_length, end, preempt, host_timer)
        return ok

    def share(self, pages: list[int], draft_pages: list[int] = ()) -> None:
        """One more reference on each page (another sample of the same prompt)."""
        self.target.share(pages)
        if self.draft is not None:
            self.draft.share(list(draft_pages))

    def rollback(self, seq) -> None:
        """Releases (in place) the sample's pages wholly past its kept history, in each
        pool (after a verification: rejected drafts' slots)."""
        self.target.truncate(seq.pages, seq.length)
        if self.draft is not None:
            self.draft.truncate(seq.draft_pages, seq.draft_length)

    def release(self, pages: list[int], draft_pages: list[int] = ()) -> None:
        """Drops one reference on each page of both pools."""
        self.target.release(pages)
        if self.draft is not None:
            self.draft.release(list(draft_pages))

    def flush_poison(self) -> None:
        """Poisons the pages freed since the last call, in both pools (debug mode)."""
        for pool in self.pools:
            pool.flush_poison()

    # -- the tries -----------------------------------------------------------------------------
    def commit(self, req, tokens: list[int] | None, salts, digests, pages: list[int],
               draft_tokens: list[int] | None = None, draft_pages: list[int] = ()) -> None:
        """The full pages of `tokens` held in `pages` enter the target's trie under the
        request's namespace (None: the target commits nothing); the full pages of
        `draft_tokens` held in `draft_pages`, the draft's under the request's draft
        namespace (an EAGLE head's: `draft_tokens` one token longer than its pairs,
        `admission.pool_keys`). `salts` and `digests` are per page of the request's
        history."""
        if tokens is not None:
            self.target.insert(req.namespace, tokens, salts, digests, pages)
        if self.draft is not None and draft_tokens is not None and draft_pages:
            self.draft.insert(self.draft.namespace(req.request.position_base),
                              *pool_keys(self.draft, draft_tokens, salts, digests),
                              list(draft_pages))

    def unbounded_blocks(self, req) -> int:
        """How many full pages of the request's context an unbounded cache would hold."""
        ctx = req.context
        return self.target.unbounded_blocks(req.namespace, ctx.tokens, ctx.salts)

    # -- device steps --------------------------------------------------------------------------
    def run(self, step: Callable[[PagedKVCache], tuple[Any, PagedKVCache]],
            draft: bool = False) -> Any:
        """A device step over the target's cache (the draft's with `draft`): `step(cache)`
        returns (result, new cache); the pool keeps the new cache."""
        return (self.draft if draft else self.target).run(step)

    def run_both(self, step: Callable[[PagedKVCache, PagedKVCache | None],
                                      tuple[Any, PagedKVCache, PagedKVCache | None]]) -> Any:
        """A device step over both caches (the draft's is None without a draft model):
        `step(cache, draft_cache)` returns (result, new cache, new draft cache)."""
        draft_cache = None if self.draft is None else self.draft.cache
        result, self.target.cache, draft_cache = step(self.target.cache, draft_cache)
        if self.draft is not None:
            self.draft.cache = draft_cache
        return result

    # -- views ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The target pool's counts for the engine's metrics (`PagePool.stats`)."""
        return self.target.stats()
