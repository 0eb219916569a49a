"""Host page allocator: a free list with reference counts. Plain Python + numpy, no JAX."""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np


class AllocatorError(RuntimeError):
    """Double free, freeing an unknown page, or asking for more pages than are free."""


class PageAllocator:
    """Hands out physical page ids; a page returns to the free list when its count is 0.

    A page with more than one reference is shared and must not be written: a writer first
    copies it (`copy_on_write`). With `track_freed`, every page that returns to the free
    list is also queued in `freed` so the owner can poison it on device (page hygiene).
    `listener(page, count)`, when set, hears every change of an allocated page's count (the
    prefix trie keeps its evictable pages current by it instead of rescanning them).
    """

    def __init__(self, num_pages: int, track_freed: bool = False):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))
        self._refs = np.zeros(num_pages, np.int32)
        self.track_freed = track_freed
        self.freed: list[int] = []
        self.copies = 0
        self.listener: Callable[[int, int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with reference count 1; all or nothing."""
        if n > len(self._free):
            raise AllocatorError(f"asked for {n} pages, only {len(self._free)} of "
                                 f"{self.num_pages} are free")
        pages = [self._free.popleft() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def share(self, page: int) -> None:
        """Adds a reference to a live page."""
        if not 0 <= page < self.num_pages or self._refs[page] < 1:
            raise AllocatorError(f"cannot share page {page}: it is not allocated")
        self._refs[page] += 1
        self._heard(page)

    def copy_on_write(self, page: int) -> int | None:
        """Before writing `page`: None if the caller holds the only reference, else a fresh
        page that replaces the caller's reference (the caller copies the contents)."""
        if self._refs[page] < 1:
            raise AllocatorError(f"page {page} is not allocated")
        if self._refs[page] == 1:
            return None
        (fresh,) = self.allocate(1)
        self._refs[page] -= 1
        self.copies += 1
        self._heard(page)
        return fresh

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; checks every page before changing any."""
        counts = collections.Counter(pages)
        for page, n in counts.items():
            if not 0 <= page < self.num_pages:
                raise AllocatorError(f"page {page} does not exist (num_pages={self.num_pages})")
            if self._refs[page] < n:
                raise AllocatorError(f"double free of page {page}")
        for page in pages:
            self._refs[page] -= 1
            self._heard(page)
            if self._refs[page] == 0:
                self._free.append(page)
                if self.track_freed:
                    self.freed.append(page)

    def _heard(self, page: int) -> None:
        if self.listener is not None:
            self.listener(page, int(self._refs[page]))


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def free_past(allocator, pages: list[int], length: int, page_size: int) -> None:
    """Rollback: returns the pages wholly past the first `length` tokens to `allocator`
    (a `PageAllocator`) and drops them from `pages` in place."""
    keep = pages_for(length, page_size)
    if len(pages) > keep:
        allocator.free(pages[keep:])
        del pages[keep:]
