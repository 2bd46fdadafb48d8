"""Physical KV pages: a free list, reference counts and reservations.

A page holds `page_size` consecutive positions of one sequence for every layer (the storage itself
lives in `PagedKVCache`). Pages are reference counted so that the K samples of a prompt can share its
full prompt pages; a page with more than one owner is never written. Admission reserves pages up front
(prompt pages + every sample's worst case), so a running sequence can always get its next page and
the engine never has to preempt anyone.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages
        self.reserved = 0  # pages promised to admitted sequences but not handed out yet

    @property
    def available(self) -> int:
        """Pages that a new admission may still reserve."""
        return len(self.free) - self.reserved

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, n: int) -> None:
        if n > self.available:
            raise OutOfPages(f"need {n} pages, {self.available} available")
        self.reserved += n

    def release(self, n: int) -> None:
        """Give back reserved pages that were never allocated."""
        assert 0 <= n <= self.reserved
        self.reserved -= n

    def allocate(self, reserved: bool = True) -> int:
        """One fresh page (refcount 1), drawn from a reservation unless `reserved` is False."""
        if reserved:
            assert self.reserved > 0, "allocation without a reservation"
            self.reserved -= 1
        elif not self.free or self.available <= 0:
            raise OutOfPages("no free page")
        page = self.free.pop()
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> int:
        assert self.refcount[page] > 0
        self.refcount[page] += 1
        return page

    def free_pages(self, pages: list[int]) -> None:
        for page in pages:
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0
            if self.refcount[page] == 0:
                self.free.append(page)

    @property
    def used(self) -> int:
        return self.num_pages - len(self.free)
