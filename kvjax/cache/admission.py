"""An admission planned before anything is committed, in every pool of the engine.

The plan takes references on the pages it would reuse (so eviction cannot take them while it
counts), checks that every pool has room, and then either commits as a unit (evict,
allocate, copy a partial page) or aborts as a unit (every reference it took is given back).
A request that does not fit waits.

A request here is what the engine holds (`kvjax.engine.requests.LiveRequest`): its
`namespace`, its `context` (tokens, salts per page, digests) and `request.position_base`.
Host code: plain Python.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvjax.cache.allocator import pages_for
from kvjax.cache.trie import Match, Node, history_digests

if TYPE_CHECKING:  # the pool holds the device cache; the plan uses its host methods only
    from kvjax.cache.pool import PagePool


@dataclasses.dataclass
class PoolPlan:
    """One pool's part of an admission: the cached pages it reuses (referenced while the
    plan lives), an optional partly matching page to copy `copied` slots from, and how many
    fresh pages it needs."""

    pool: PagePool
    nodes: list[Node]  # matched trie nodes, touched on commit (LRU time, LFU hits)
    reused: list[int]
    fresh: int
    copy_from: int | None = None
    copied: int = 0
    # reused tokens whose pages a lower tier restored for this admission, per tier
    restored: dict[str, int] = dataclasses.field(default_factory=dict)

    def hold(self) -> None:
        self.pool.share(self.held)

    @property
    def held(self) -> list[int]:
        return self.reused + ([] if self.copy_from is None else [self.copy_from])

    @property
    def fits(self) -> bool:
        return self.pool.room >= self.fresh

    @property
    def reused_tokens(self) -> int:
        """Tokens of the context the plan reuses (its whole cached pages)."""
        return len(self.reused) * self.pool.page_size

    def drop_copy(self) -> None:
        """Recompute the partly matching page instead of copying it."""
        if self.copy_from is not None:
            self.pool.release([self.copy_from])
            self.copy_from, self.copied = None, 0

    def abort(self) -> None:
        self.pool.release(self.held)

    def commit(self) -> list[int]:
        """Evicts what it must and allocates the fresh pages (host work); returns the
        sequence's pages, the reused ones first. `write` makes them ready on device."""
        self.pool.reserve(self.fresh)
        self.pool.trie.touch(self.nodes)
        for node in self.nodes[:len(self.reused)]:
            if node.restored_from is not None:  # the first reuse of a restored page
                tier = node.restored_from
                self.restored[tier] = self.restored.get(tier, 0) + self.pool.page_size
                node.restored_from = None
        return self.reused + self.pool.allocate(self.fresh)

    def write(self, pages: list[int]) -> None:
        """Poisons what was freed (debug mode) and copies the partly matching page into
        the first fresh one, then lets the copy source go."""
        self.pool.flush_poison()
        if self.copy_from is not None:
            self.pool.copy_page(self.copy_from, pages[len(self.reused)])
            self.pool.release([self.copy_from])


@dataclasses.dataclass
class Admission:
    """An admission planned for the target pool and (with a draft model) the draft's."""

    match: Match  # the target's match, for the request's stats
    target: PoolPlan
    draft: PoolPlan | None

    @property
    def reuse(self) -> int:
        return len(self.target.reused)

    @property
    def start(self) -> int:
        """The first token prefill computes."""
        return self.target.reused_tokens + self.target.copied

    def abort(self) -> None:
        """Gives back every reference the plan holds, in both pools."""
        for plan in (self.target, self.draft):
            if plan is not None:
                plan.abort()


def pool_keys(pool: PagePool, tokens: list[int], salts, digests
              ) -> tuple[list[int], list, list[bytes]]:
    """(tokens, salts, digests) under which `pool`'s pages of a history `tokens` enter and
    match its trie. A pool whose slot j depends on `pool.lead` tokens past token j (an
    EAGLE head's pairs) keys block i by tokens[lead + iP : lead + (i + 1)P], salted as the
    page of its last token (a public page's pairs may read a tenant's first token), and
    names the first `lead` tokens in block 0's salt: a page matches only where every token
    it depends on does. `tokens` then holds `lead` more tokens than the pool's slots."""
    lead, ps = pool.lead, pool.page_size
    if not lead or not tokens:
        return tokens, salts, digests
    salts = [salts[min(((i + 1) * ps + lead - 1) // ps, len(salts) - 1)]
             for i in range(len(salts))] or [None]
    first = f"after:{list(tokens[:lead])}"
    salts[0] = first if salts[0] is None else f"{salts[0]}|{first}"
    rest = list(tokens[lead:])
    return rest, salts, history_digests(rest, ps)


def match(pool: PagePool, req, prefix_cache: bool, draft: bool = False) -> Match:
    """The pool's longest cached prefix of the request's context (the draft's namespace
    has no adapter)."""
    if not prefix_cache:
        return Match([], "prefix_cache_off")
    namespace = pool.namespace(req.request.position_base) if draft else req.namespace
    ctx = req.context
    return pool.match(namespace, *pool_keys(pool, ctx.tokens, ctx.salts, ctx.digests))


def plan_admission(req, target: PagePool, draft: PagePool | None, prefix_cache: bool,
                   partial_page_copy: bool) -> Admission | None:
    """The admission of `req` with every reused page referenced, or None (nothing held)
    when a pool has no room for it yet."""
    ps, n_tok = target.page_size, len(req.context.tokens)
    found = match(target, req, prefix_cache)
    reuse = min(len(found.nodes), (n_tok - 1) // ps)  # at least one token is computed
    lead = draft is not None and draft.lead > 0
    if lead:  # an EAGLE head's pairs are made from the target's prefill: the target
        # recomputes what the head does not hold (pages the head matched, no partial copy)
        draft_found = match(draft, req, prefix_cache, draft=True)
        if len(draft_found.nodes) < reuse:  # the request is told why: cause "draft"
            reuse = len(draft_found.nodes)
            found = Match(found.nodes[:reuse], "draft")
    # Every matched node is touched, the last full page's too when it is recomputed.
    plan = PoolPlan(target, found.nodes, found.pages[:reuse], pages_for(n_tok, ps) - reuse)
    if partial_page_copy and not lead:
        room = n_tok - 1 - reuse * ps
        if reuse < len(found.nodes):
            plan.copy_from, plan.copied = found.nodes[reuse].page, min(ps, room)
        elif found.partial is not None:
            plan.copy_from, plan.copied = found.partial[0].page, min(found.partial[1], room)
        if plan.copied <= 0:
            plan.copy_from, plan.copied = None, 0
    draft_plan = None
    if draft is not None:
        if not lead:
            draft_found = match(draft, req, prefix_cache, draft=True)
        reused = draft_found.pages[: reuse if lead else n_tok // ps]
        draft_plan = PoolPlan(draft, draft_found.nodes[: len(reused)], reused,
                              pages_for(n_tok, ps) - len(reused))
        draft_plan.hold()
        if not draft_plan.fits:
            draft_plan.abort()
            return None
    plan.hold()
    if not plan.fits:
        plan.drop_copy()
    admission = Admission(found, plan, draft_plan)
    if not plan.fits:
        admission.abort()
        return None
    return admission
