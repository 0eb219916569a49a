"""Who runs where: the waiting queue, the batch slots, the admission order and plan, and the
preemption order. Host code: plain Python (the pools are used through their host methods).

Admission is planned before anything is committed: the plan takes references on the pages
it would reuse (so eviction cannot take them while it counts), checks that every pool has
room, and then either commits as a unit (evict, allocate, copy a partial page) or aborts as
a unit (every reference it took is given back). A request that does not fit waits.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvjax.cache.trie import Match, Node
from kvjax.decode.batching import pages_for
from kvjax.engine.requests import LiveRequest, Seq

if TYPE_CHECKING:
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

    def hold(self) -> None:
        for page in self.held:
            self.pool.allocator.share(page)

    @property
    def held(self) -> list[int]:
        return self.reused + ([] if self.copy_from is None else [self.copy_from])

    @property
    def fits(self) -> bool:
        return self.pool.room >= self.fresh

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
        return self.reused + self.pool.allocator.allocate(self.fresh)

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
        return self.reuse * self.target.pool.cache_config.page_size + self.target.copied

    def abort(self) -> None:
        """Gives back every reference the plan holds, in both pools."""
        for plan in (self.target, self.draft):
            if plan is not None:
                plan.abort()


def match(pool: PagePool, req: LiveRequest, prefix_cache: bool, draft: bool = False) -> Match:
    """The pool's longest cached prefix of the request's context (the draft's namespace
    has no adapter)."""
    if not prefix_cache:
        return Match([], "prefix_cache_off")
    namespace = pool.namespace(req.request.position_base) if draft else req.namespace
    ctx = req.context
    return pool.trie.match(namespace, ctx.tokens, ctx.salts, ctx.digests, touch=False)


def plan_admission(req: LiveRequest, target: PagePool, draft: PagePool | None,
                   prefix_cache: bool, partial_page_copy: bool) -> Admission | None:
    """The admission of `req` with every reused page referenced, or None (nothing held)
    when a pool has no room for it yet."""
    ps, n_tok = target.cache_config.page_size, len(req.context.tokens)
    found = match(target, req, prefix_cache)
    reuse = min(len(found.nodes), (n_tok - 1) // ps)  # at least one token is computed
    # Every matched node is touched, the last full page's too when it is recomputed.
    plan = PoolPlan(target, found.nodes, found.pages[:reuse], pages_for(n_tok, ps) - reuse)
    if partial_page_copy:
        room = n_tok - 1 - reuse * ps
        if reuse < len(found.nodes):
            plan.copy_from, plan.copied = found.nodes[reuse].page, min(ps, room)
        elif found.partial is not None:
            plan.copy_from, plan.copied = found.partial[0].page, min(found.partial[1], room)
        if plan.copied <= 0:
            plan.copy_from, plan.copied = None, 0
    draft_plan = None
    if draft is not None:
        draft_found = match(draft, req, prefix_cache, draft=True)
        reused = draft_found.pages[: n_tok // ps]
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


class Scheduler:
    """The waiting queue (preempted requests go first), the batch slots, which request is
    admitted next (fcfs, or lpm: the longest cached prefix first) and which is preempted
    (the youngest admitted after the one that needs pages)."""

    def __init__(self, max_slots: int, schedule: str):
        self.waiting: collections.deque[LiveRequest] = collections.deque()
        self.slots: list[Seq | None] = [None] * max_slots
        self.schedule = schedule
        self.admissions = 0

    @property
    def running(self) -> list[Seq]:
        return [s for s in self.slots if s is not None]

    @property
    def num_running(self) -> int:
        return len({s.req.id for s in self.running})

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    def pick(self, cached_pages: Callable[[LiveRequest], int]) -> LiveRequest:
        """The next request to admit; `cached_pages` counts a request's reusable pages."""
        if self.schedule == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        return max(self.waiting, key=lambda r: (cached_pages(r), -r.id))

    def seat(self, req: LiveRequest, slots: list[int]) -> None:
        """Gives each sample of an admitted request a slot."""
        for seq, slot in zip(req.seqs, slots, strict=False):
            seq.slot = slot
            self.slots[slot] = seq
        self.waiting.remove(req)
        self.admissions += 1
        req.admitted_order = self.admissions

    def vacate(self, seq: Seq) -> None:
        if seq.slot is not None:
            self.slots[seq.slot] = None
            seq.slot = None

    def decode_order(self) -> list[Seq]:
        """The running samples, oldest admission first (they grow first)."""
        return sorted(self.running, key=lambda s: s.req.admitted_order)

    def victim(self, requester: LiveRequest) -> LiveRequest | None:
        """The request to preempt for `requester`: the youngest admitted after it."""
        younger = {s.req for s in self.running if s.req.admitted_order > requester.admitted_order}
        return max(younger, key=lambda r: r.admitted_order) if younger else None


def shares_uncached(req: LiveRequest, reused: int, prefilling: list[LiveRequest],
                    page_size: int) -> bool:
    """Whether `req` has a full page past its `reused` cached pages equal (tokens, salt,
    namespace) to one a request being prefilled is about to write."""
    for other in prefilling:
        if other.namespace != req.namespace:
            continue
        common = 0
        mine, theirs = req.context, other.context
        for i in range(min(len(mine.tokens), len(theirs.tokens)) // page_size):
            span = slice(i * page_size, (i + 1) * page_size)
            if mine.tokens[span] != theirs.tokens[span] or mine.salts[i] != theirs.salts[i]:
                break
            common += 1
        if common > reused:
            return True
    return False


def reused_tokens(plan: PoolPlan) -> int:
    """Tokens of the context a pool's plan reuses (its whole cached pages)."""
    return len(plan.reused) * plan.pool.cache_config.page_size
