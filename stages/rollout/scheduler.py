"""Continuous batching: who runs in the next engine step.

Three queues. `waiting`: requests not yet prefilled. `ready`: samples whose prompt is prefilled (and
whose first token is sampled) but that have no slot in the running batch yet, e.g. the samples of a
prompt with n > --max-batch. `running`: at most `max_batch` samples decoded together.

Each step: ready samples fill free slots first; if slots are still free, waiting requests are
admitted (FIFO, as many as the free slots, the prefill token cap and the page pool allow) and the
step is a prefill; otherwise it is a decode step over everything running. Finished samples leave
the batch after every step, so the next step can take new ones in. Admission reserves every page the
request can need (its full prompt pages once, plus each sample's own pages up to max_new_tokens), so
a running sample never waits for memory and nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Request, Sequence, Status


def pages_needed(prompt_len: int, n: int, max_new: int, page: int) -> tuple[int, int]:
    """(shared full prompt pages, own pages per sample) for a request.

    A sample caches at most prompt + max_new - 1 tokens (the last sampled token is never fed back);
    its own pages are everything past the full prompt pages, including its copy of a partial one.
    """
    shared = prompt_len // page
    own = -(-(prompt_len + max_new - 1) // page) - shared
    return shared, own


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int):
        self.blocks, self.max_batch, self.max_prefill_tokens = blocks, max_batch, max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    def need(self, r: Request) -> int:
        shared, own = pages_needed(len(r.prompt), r.params.n, r.params.max_new_tokens, self.blocks.page_size)
        return shared + r.params.n * own

    def schedule(self) -> tuple[str, list]:
        """('prefill', requests) or ('decode', running samples)."""
        while self.ready and len(self.running) < self.max_batch:
            seq = self.ready.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        free_slots = self.max_batch - len(self.running)
        admitted, tokens = [], 0
        while self.waiting and free_slots > 0 and not self.ready:
            r = self.waiting[0]
            if admitted and tokens + len(r.prompt) > self.max_prefill_tokens:
                break
            need = self.need(r)
            if need > self.blocks.available:
                if need > self.blocks.num_pages:
                    raise RuntimeError(f"request {r.request_id} needs {need} KV pages but the pool has "
                                       f"only {self.blocks.num_pages}")
                break  # wait for running samples to finish and give their pages back
            self.blocks.reserve(need)
            self.waiting.popleft()
            admitted.append(r)
            tokens += len(r.prompt)
            free_slots -= r.params.n
        if admitted:
            return "prefill", admitted
        return "decode", list(self.running)

    def admit_prefilled(self, seqs: list[Sequence]) -> None:
        self.ready.extend(seqs)
        while self.ready and len(self.running) < self.max_batch:
            seq = self.ready.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Give a finished sample's pages and unused reservation back."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.free_pages(seq.pages)
        self.blocks.release(seq.reserved)
        seq.pages, seq.reserved = [], 0
