"""Physical KV pages: a free list and reference counts.

A page holds `page_size` consecutive positions of one sequence for every layer (the storage itself
lives in `PagedKVCache`). Pages are reference counted so that the n samples of a prompt share all of
its pages after the prefill, the partial last one included; a page with more than one owner is never
written: the scheduler gives a sample its own copy before its first write (copy on write). Pages are
handed out as sequences grow, not reserved up front; when none is free the scheduler preempts
(scheduler.py).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages
        self.held: dict[int, list[int]] = {}  # page runs held for a cache beside the samples', by key


    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self) -> int:
        """One fresh page (refcount 1)."""
        if not self.free:
            raise OutOfPages("no free page")
        page = self.free.pop()
        self.refcount[page] = 1
        return page

    def allocate_run(self, count: int) -> list[int] | None:
        """`count` free pages with consecutive ids (refcount 1 each), the lowest such run; None when the
        free pages hold no run that long."""
        free = sorted(self.free)
        for i in range(len(free) - count + 1):
            if free[i + count - 1] - free[i] == count - 1:  # sorted and distinct: consecutive
                run = free[i: i + count]
                taken = set(run)
                self.free = [p for p in self.free if p not in taken]
                for page in run:
                    self.refcount[page] = 1
                return run
        return None

    def hold_run(self, key: int, count: int) -> list[int] | None:
        """A run of `count` consecutive pages held under `key` (in no block table) until `release(key)`,
        or until `reclaim()` gives it back first; None when no such run is free."""
        run = self.allocate_run(count)
        if run is not None:
            self.held[key] = run
        return run

    def release(self, key: int) -> None:
        if key in self.held:
            self.free_pages(self.held.pop(key))

    def reclaim(self) -> bool:
        """Give the newest held run back (before anyone is preempted); False if none is held."""
        if not self.held:
            return False
        self.release(next(reversed(self.held)))
        return True

    def share(self, page: int) -> int:
        assert self.refcount[page] > 0
        self.refcount[page] += 1
        return page

    def free_pages(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds goes back to the free list."""
        for page in pages:
            self.refcount[page] -= 1
            assert self.refcount[page] >= 0
            if self.refcount[page] == 0:
                self.free.append(page)
