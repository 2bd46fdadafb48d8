"""Continuous batching with pages on demand and preemption by recompute: what the next engine step runs.

Three queues: `waiting` (requests not prefilled, and preempted samples at the front), `ready` (prefilled
samples without a slot) and `running` (at most `max_batch` samples decoded together). Each step ready
samples fill free slots, then waiting entries are admitted as slots, the prefill token cap and free pages
allow (a prefill step), else every running sample decodes. Before a decode step each running sample gets
the page its next token goes to (a fresh one, or its copy of a shared one), and evicting samples that
reached budget + buffer are compressed; when no page is free, held pages are reclaimed and then the
latest admitted sample is preempted (vLLM's choice). The oldest running sample is never the victim, so
a schedule cannot stall. `schedule()` returns the plan; the engine applies it through the runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .compaction import Compaction
from .sequence import Request, Sequence, Status


def pages_needed(prompt_len: int, n: int, max_new: int, page: int) -> tuple[int, int]:
    """(shared full prompt pages, own pages per sample) of a request at its samples' full length,
    the worst case a pool is sized for (pages on demand never need more).

    A sample caches at most prompt + max_new - 1 tokens (the last sampled token is never fed back);
    its own pages are everything past the full prompt pages, including its copy of a partial one.
    """
    shared = prompt_len // page
    own = -(-(prompt_len + max_new - 1) // page) - shared
    return shared, own


def prefill_tokens(entry: Request | Sequence) -> list[int]:
    """What a prefill of `entry` feeds: a request's prompt, or a preempted sample's prompt and every
    generated token but the last (the last is fed by its next decode step)."""
    if isinstance(entry, Request):
        return entry.prompt
    return entry.request.prompt + entry.tokens[:-1]


@dataclass
class Step:
    """The next engine step: a prefill of `batch` (requests and preempted samples), or a decode step of
    the running samples once the runner has run `compactions` and then copied pages `copy_src` to
    `copy_dst` (copy on write; compactions read pages the copies may overwrite)."""

    kind: str  # "prefill" | "decode"
    batch: list
    compactions: list[Compaction] = field(default_factory=list)
    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int, speculate: int = 0):
        """Pages held beside the samples' (`BlockManager.hold_run`) are reclaimed before anyone is
        preempted. `speculate` = K: a decode step is a speculative cycle whose samples write up to K + 1
        slots (speculative.py), so each gets the pages of those slots."""
        self.blocks, self.max_batch, self.max_prefill_tokens = blocks, max_batch, max_prefill_tokens
        self.speculate = speculate
        # the most pages one sample's step takes: its copy of a shared page and the pages its slots reach
        self.step_pages = 1 + -(-speculate // blocks.page_size)
        self.waiting: deque[Request | Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.compactions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    def prefill_pages(self, entry: Request | Sequence) -> int:
        """Pages a prefill of `entry` writes: its prompt's, or a recompute's cache (an evicting sample's
        retained cache only)."""
        if isinstance(entry, Sequence) and entry.policy.evicts:
            fed = len(entry.tokens) - 1
            return self.blocks.pages_for(entry.policy.cache_len(len(entry.request.prompt), fed))
        return self.blocks.pages_for(len(prefill_tokens(entry)))

    def _due(self, seq: Sequence) -> bool:
        return seq.policy.compression_due(seq.cached, len(seq.tokens) + seq.pending - 1)  # in flight too

    def _fresh_pages(self, seq: Sequence) -> int:
        """Fresh pages the sample's compression takes: the budget's pages it does not own alone."""
        own = sum(self.blocks.refcount[p] == 1 for p in seq.pages)
        return max(0, self.blocks.pages_for(seq.policy.budget) - own)

    def page_need(self, seq: Sequence) -> int:
        """The pages the sample's next decode step takes: 1 if its token needs one (a fresh one, or a
        copy of a shared one); for a sample due a compression, its fresh pages and the next token's."""
        if self._due(seq):
            return self._fresh_pages(seq) + int(seq.policy.budget % self.blocks.page_size == 0)
        i, last = self._step_pages(seq)  # the pages of the slots its step writes
        shared = i < len(seq.pages) and self.blocks.refcount[seq.pages[i]] > 1
        return max(0, last + 1 - len(seq.pages)) + int(shared)

    def _step_pages(self, seq: Sequence) -> tuple[int, int]:
        """(first, last) logical page of the slots the sample's next step writes: its next token's, and
        with speculation those of its drafts' and their verification."""
        slots = 1
        if self.speculate:
            slots += max(0, min(self.speculate, seq.request.params.max_new_tokens - len(seq.tokens) - 1))
        return seq.cached // self.blocks.page_size, (seq.cached + slots - 1) // self.blocks.page_size

    def _spare(self) -> int:
        """Free pages beyond those the running batch's next decode step takes."""
        return self.blocks.num_free - sum(self.page_need(s) for s in self.running)

    def schedule(self) -> Step:
        """A prefill of waiting requests and preempted samples, else a decode step of the running ones."""
        self._fill_slots()
        admitted = self._admit()
        if admitted:
            return Step("prefill", admitted)
        step = self._grow()
        step.batch = list(self.running)
        return step

    def _fill_slots(self) -> None:
        """Ready samples join the batch while slots and their next pages are free; with nothing
        running, the first joins anyway (the decode step then preempts to make its room)."""
        spare = self._spare()
        while self.ready and len(self.running) < self.max_batch:
            need = self.page_need(self.ready[0])
            if need > spare and self.running:
                break
            spare -= need
            seq = self.ready.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _admit(self) -> list[Request | Sequence]:
        free_slots = self.max_batch - len(self.running)
        spare = self._spare()
        admitted, tokens = [], 0
        while self.waiting and free_slots > 0 and not self.ready:
            entry = self.waiting[0]
            n_tok = len(prefill_tokens(entry))
            if admitted and tokens + n_tok > self.max_prefill_tokens:
                break
            pages = self.prefill_pages(entry)
            samples = min(entry.params.n, free_slots) if isinstance(entry, Request) else 1
            # each sample joining the batch may take a page at its first decode step; with nothing
            # running or admitted, the prompt's pages alone (which always fit) are enough to go
            growth = samples * self.step_pages if (admitted or self.running) else 0
            if pages + growth > spare:
                break
            spare -= pages + growth
            self.waiting.popleft()
            admitted.append(entry)
            tokens += n_tok
            free_slots -= entry.params.n if isinstance(entry, Request) else 1
        return admitted

    def _grow(self) -> Step:
        """Plan the compressions of the running samples that are due, then give every running sample the
        page its next token goes to, oldest first, preempting the latest admitted when none is free."""
        src, dst, plans = [], [], []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self._due(seq):
                while seq.status == Status.RUNNING and self._fresh_pages(seq) > self.blocks.num_free:
                    if not self.blocks.reclaim():
                        self.preempt(self._victim(seq, i))
                if seq.status != Status.RUNNING:
                    break
                plans.append(self._plan_compaction(seq))
            while seq.status == Status.RUNNING and self.page_need(seq) > self.blocks.num_free:
                if not self.blocks.reclaim():
                    self.preempt(self._victim(seq, i))
            if seq.status != Status.RUNNING:
                break  # it was the latest admitted itself: everyone before it has their page
            p, last = self._step_pages(seq)
            if p < len(seq.pages) and self.blocks.refcount[seq.pages[p]] > 1:
                page = self.blocks.allocate()  # copy on write; copies run batched, reads before writes
                src.append(seq.pages[p])
                dst.append(page)
                self.blocks.free_pages([seq.pages[p]])
                seq.pages[p] = page
            while len(seq.pages) <= last:
                seq.pages.append(self.blocks.allocate())
            i += 1
        self.compactions += len(plans)
        return Step("decode", [], plans, src, dst)

    def _plan_compaction(self, seq: Sequence) -> Compaction:
        """The sample's compressed cache goes to its own pages first, then fresh ones; the rest go back."""
        blocks = self.blocks
        keep = blocks.pages_for(seq.policy.budget)
        own = [p for p in seq.pages if blocks.refcount[p] == 1][:keep]
        new = own + [blocks.allocate() for _ in range(keep - len(own))]
        plan = Compaction(seq, list(seq.pages), new, seq.cached)
        kept = set(new)
        blocks.free_pages([p for p in seq.pages if p not in kept])
        seq.pages, seq.cached = new, seq.policy.budget
        seq.compactions += 1
        return plan

    def _victim(self, seq: Sequence, i: int) -> Sequence:
        """The latest admitted: the end of `running` after `seq`, else the end of `ready` (not yet
        running), else `seq` itself unless it is the oldest, which always gets its page."""
        if self.running[-1] is not seq:
            return self.running[-1]
        if self.ready:
            return self.ready[-1]
        if i > 0:
            return seq
        raise RuntimeError(f"request {seq.request.request_id} needs more KV pages than the pool's "
                           f"{self.blocks.num_pages}")  # refused at add_request; never reached

    def preempt(self, seq: Sequence) -> None:
        """Drop the sample's pages and queue it, first in line, for recompute."""
        (self.running if seq.status == Status.RUNNING else self.ready).remove(seq)
        self.blocks.free_pages(seq.pages)
        seq.pages = []
        seq.status = Status.PREEMPTED
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def admit_prefilled(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.status = Status.READY
        self.ready.extend(seqs)
        self._fill_slots()

    def finish(self, seq: Sequence) -> None:
        """Give a finished sample's pages back."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free_pages(seq.pages)
        seq.pages = []
