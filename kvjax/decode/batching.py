"""Host-side batch descriptions: bucketed shapes and page tables (numpy only)."""

from __future__ import annotations

import numpy as np

from kvjax.cache.allocator import free_past, pages_for

__all__ = ["bucket", "free_past", "page_table", "pages_for"]


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power-of-two multiple of `minimum` that is >= n."""
    size = minimum
    while size < n:
        size *= 2
    return size


def page_table(rows: list[list[int]], num_slots: int, block_pages: int,
               longest: int = 1) -> np.ndarray:
    """int32[num_slots, P]: each row's pages, padded with page 0 (never read past a length),
    wide enough for `longest` pages too (tables that must share one width).

    P is bucketed to a power-of-two number of attention blocks, so sequences that grow one
    page at a time compile a logarithmic number of shapes. It is never a single block: with
    one block XLA knows the attention loop runs at most once, specialises it, and the result
    differs from the looped one in the last bits, which
    would make a sequence's arithmetic depend on its batch mates' lengths.
    """
    width = bucket(max([longest, *(len(r) for r in rows)]), 2 * block_pages)
    table = np.zeros((num_slots, width), np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table
