from __future__ import annotations

import pytest

from kvjax import AllocatorError, PageAllocator


def test_allocate_free_and_refcounts():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2]
    assert alloc.num_free == 1
    assert all(alloc.refcount(p) == 1 for p in a)
    alloc.free(a[:1])
    assert alloc.num_free == 2
    assert alloc.refcount(a[0]) == 0
    b = alloc.allocate(2)
    assert set(b) == {3, a[0]}


def test_all_or_nothing_and_double_free():
    alloc = PageAllocator(4)
    with pytest.raises(AllocatorError, match="only 4 of 4"):
        alloc.allocate(5)
    assert alloc.num_free == 4
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(AllocatorError, match="double free of page"):
        alloc.free(pages)
    pages = alloc.allocate(1)
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free(pages + pages)  # checked before anything changes
    assert alloc.refcount(pages[0]) == 1
    with pytest.raises(AllocatorError, match="does not exist"):
        alloc.free([7])
