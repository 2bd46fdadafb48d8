"""Eviction in the paged pool: the query windows the rule reads, and compaction between decode steps.

`QueryWindows`: each running sample's last W post-RoPE queries per layer, in a ring in the pool that the
decode step writes (one index copy per layer, graph-safe), filled at first decode from its prompt's
queries or a recompute's replay. `compact`: the compressions the scheduler planned, layer by layer:
score each sample's cached keys against its window, gather the kept keys and values and write them to
slots 0..budget-1 of the target pages with their centroids. Keys are post-RoPE, so they keep their
meaning wherever they move.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention.kv_cache import PagedKVCache, upload
from .sequence import Sequence


@dataclass
class Compaction:
    """One sample's compression: its cache of `length` tokens in `old` pages goes to `new` pages
    (slots 0..budget-1), planned by the scheduler, run by the runner before the next decode step."""

    seq: Sequence
    old: list[int]
    new: list[int]
    length: int


class QueryWindows:
    """The per-run bookkeeping of the pool's query ring (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, slots: int):
        assert cache.queries is not None
        self.cache, self.width = cache, cache.window
        self.trash = cache.queries.shape[1] - 1
        self.free = list(range(slots - 1, -1, -1))
        self.slot_of: dict[Sequence, int] = {}
        self.prompt: dict[int, Tensor] = {}  # request id -> [layers, W, Hq, D] in ring order
        self.unfinished: dict[int, int] = {}  # request id -> samples not finished
        self.pending: dict[Sequence, Tensor] = {}  # a recomputed sample's window, until it gets a slot

    def prompt_window(self, request_id: int, window: int, samples: int) -> Tensor:
        """The buffer a fresh request's prefill writes its last `window` queries into."""
        q = self.cache.queries
        self.prompt[request_id] = torch.zeros(q.shape[0], window, q.shape[2], q.shape[3], dtype=q.dtype,
                                              device=q.device)
        self.unfinished[request_id] = samples
        return self.prompt[request_id]

    def indices(self, seqs: Seq[Sequence]) -> list[int]:
        """Where each row's query goes this decode step (the trash row for a sample that evicts nothing),
        giving slots to evicting samples that have none and taking them back from samples that left."""
        return [self.trash if base < 0 else base + seq.position % seq.policy.window
                for seq, base in zip(seqs, self.bases(seqs))]

    def bases(self, seqs: Seq[Sequence]) -> list[int]:
        """Each row's first ring row (-1 for a sample that evicts nothing), slots given and taken back
        as in `indices`; the static decode step adds position mod window on the device."""
        batch = set(seqs)
        for seq in [s for s in self.slot_of if s not in batch]:
            self.free.append(self.slot_of.pop(seq))
        out = []
        for seq in seqs:
            if not seq.policy.evicts:
                out.append(-1)
                continue
            slot, start = self.slot_of.get(seq), self.pending.pop(seq, None)  # a replayed window wins
            if slot is None:
                slot = self.slot_of[seq] = self.free.pop()
                if start is None:
                    start = self.prompt[seq.request.request_id]
            if start is not None:
                self.rows(seq, slot).copy_(start)
            out.append(slot * self.width)
        return out

    def rows(self, seq: Sequence, slot: int | None = None) -> Tensor:
        """The sample's window in the ring: [layers, W, Hq, D] (a view)."""
        slot = self.slot_of[seq] if slot is None else slot
        return self.cache.queries[:, slot * self.width: slot * self.width + seq.policy.window]

    def finished(self, request_id: int) -> None:
        if request_id in self.unfinished:
            self.unfinished[request_id] -= 1
            if self.unfinished[request_id] == 0:
                del self.unfinished[request_id], self.prompt[request_id]


def compact(cache: PagedKVCache, windows: QueryWindows, plans: Seq[Compaction]) -> None:
    """Run the planned compressions (see the module docstring); samples of one policy and cache length
    go together."""
    groups: dict[tuple, list[Compaction]] = {}
    for plan in plans:
        groups.setdefault((plan.seq.policy, plan.length), []).append(plan)
    for (policy, length), group in groups.items():
        _compact_group(cache, windows, policy, length, group)


def _compact_group(cache: PagedKVCache, windows: QueryWindows, policy, length: int,
                   group: list[Compaction]) -> None:
    dev, size = cache.k.device, cache.page_size
    width = -(-length // size)
    old = upload(dev, [p.old[:width] for p in group], torch.long)  # [m, pages]
    new = upload(dev, [p.new for p in group], torch.long)  # [m, c]
    budget = policy.budget
    slots = torch.arange(budget, device=dev)
    target_pages, offsets = new[:, slots // size], (slots % size).expand(len(group), -1)  # [m, budget]
    counts = torch.clamp(budget - torch.arange(new.shape[1], device=dev) * size, max=size)  # per new page
    for layer in range(cache.k.shape[0]):
        k_pages, v_pages, centroids = cache.layer(layer)
        keys, values = _gather(k_pages, old, length), _gather(v_pages, old, length)  # [m, Hkv, L, D]
        q_window = torch.stack([windows.rows(p.seq)[layer] for p in group]).transpose(1, 2)  # [m, Hq, W, D]
        kept = policy.retained(q_window, keys)[..., None].expand(-1, -1, -1, keys.shape[3])
        k_kept, v_kept = keys.gather(2, kept), values.gather(2, kept)  # [m, Hkv, budget, D]
        k_pages[target_pages, :, offsets] = k_kept.transpose(1, 2)
        v_pages[target_pages, :, offsets] = v_kept.transpose(1, 2)
        centroids[new] = _page_means(k_kept, new.shape[1], size, counts).transpose(1, 2).to(centroids.dtype)


def _gather(pages: Tensor, table: Tensor, length: int) -> Tensor:
    """Pool pages [N, Hkv, P, D] along block tables [m, w] -> positions 0..length-1 [m, Hkv, length, D]."""
    g = pages[table]  # [m, w, Hkv, P, D]
    m, w, hkv, p, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(m, hkv, w * p, d)[:, :, :length]


def _page_means(keys: Tensor, pages: int, size: int, counts: Tensor) -> Tensor:
    """keys [m, Hkv, n, D] in slots 0..n-1 -> each page's mean key [m, Hkv, pages, D] float32."""
    m, hkv, n, d = keys.shape
    padded = torch.zeros(m, hkv, pages * size, d, dtype=torch.float32, device=keys.device)
    padded[:, :, :n] = keys.float()
    return padded.view(m, hkv, pages, size, d).sum(3) / counts.to(torch.float32)[:, None]


def write_retained(cache: PagedKVCache, pages: list[int], keys: list[Tensor], values: list[Tensor]) -> None:
    """A recomputed sample's retained cache (per layer keys/values [Hkv, L, D], slot order) into its fresh
    pages, with their centroids."""
    dev, size = cache.k.device, cache.page_size
    length = keys[0].shape[1]
    table = torch.tensor(pages, device=dev)
    slots = torch.arange(length, device=dev)
    target, offsets = table[slots // size], slots % size
    counts = torch.clamp(length - torch.arange(len(pages), device=dev) * size, max=size)
    for layer, (k, v) in enumerate(zip(keys, values)):
        k_pages, v_pages, centroids = cache.layer(layer)
        k_pages[target, :, offsets] = k.transpose(0, 1).to(k_pages.dtype)
        v_pages[target, :, offsets] = v.transpose(0, 1).to(v_pages.dtype)
        means = _page_means(k[None], len(pages), size, counts)[0]  # [Hkv, pages, D]
        centroids[table] = means.transpose(0, 1).to(centroids.dtype)
