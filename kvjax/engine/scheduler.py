"""Who runs where: the waiting queue, the batch slots, the admission order and the
preemption order. Host code: plain Python. The admission plan itself is page work, in
`kvjax.cache.admission` (re-exported here under the names it had).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable

from kvjax.cache.admission import Admission, PoolPlan, match, plan_admission
from kvjax.engine.requests import LiveRequest, Seq

__all__ = ["Admission", "PoolPlan", "Scheduler", "match", "plan_admission", "reused_tokens",
           "shares_uncached"]


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
    """Deprecated: `PoolPlan.reused_tokens`."""
    warnings.warn("scheduler.reused_tokens(plan) is plan.reused_tokens", DeprecationWarning,
                  stacklevel=2)
    return plan.reused_tokens
