"""Host page allocator: a free list with reference counts. Plain Python + numpy, no JAX."""

from __future__ import annotations

import collections

import numpy as np


class AllocatorError(RuntimeError):
    """Double free, freeing an unknown page, or asking for more pages than are free."""


class PageAllocator:
    """Hands out physical page ids; a page returns to the free list when its count is 0."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))
        self._refs = np.zeros(num_pages, np.int32)

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
            if self._refs[page] == 0:
                self._free.append(page)
