"""The cascade's prompt copies: each group's full prompt pages copied once, at prefill, into pool pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.kernels.cpu_attention import pack_keys, pack_values, packed_key_shape, packed_value_shape

from ...attention.kv_cache import PagedKVCache
from ..block_manager import BlockManager


@dataclass
class SharedPrefix:
    """The full prompt pages that the samples of one request share, with a contiguous copy of their
    keys, values and centroids taken at prefill, which cascade attention and page scoring read once
    per decode step for all the samples whose block table starts with `pages`
    (kernels/cascade_decode.py). Full prompt pages are never written again, so the copy stays exact.

    The copy lives in the pool: `run` is as many pool pages with consecutive ids, held for the copy
    (and in no block table), whose storage in layer l, [len(run), Hkv, P, D] contiguous, is viewed as
    the [Hkv, len(run) * P, D] the flash call reads; their centroid rows hold the prompt pages'
    centroids in the pool's own layout. So the copy counts against the pool (--kv-pages) like any page."""

    pages: tuple[int, ...]
    run: tuple[int, ...]
    tokens: int
    k: list[torch.Tensor]  # per layer [Hkv, tokens, D] model dtype, a view of the pool (or packed)
    v: list[torch.Tensor]
    centroids: list[torch.Tensor]  # per layer [len(pages), Hkv, D] float32, a view of the pool
    packed: bool = False  # k and v in the C++ prefix kernel's layouts (kernels/cpu_attention.py)

    @classmethod
    def in_pool(cls, cache: PagedKVCache, pages: list[int], run: list[int],
                packed: bool = False) -> SharedPrefix:
        """The store of prompt `pages` in the pool pages `run` (consecutive ids, as many as `pages`)."""
        assert len(run) == len(pages) and run == list(range(run[0], run[0] + len(run)))
        first, end = run[0], run[0] + len(run)
        hkv, size, d = cache.k.shape[2:]
        tokens = len(run) * size
        k_shape = packed_key_shape(hkv, tokens, d, cache.k[0].dtype) if packed else (hkv, tokens, d)
        v_shape = packed_value_shape(hkv, tokens, d, cache.k[0].dtype) if packed else (hkv, tokens, d)
        return cls(tuple(pages), tuple(run), tokens, [k[first:end].view(k_shape) for k in cache.k],
                   [v[first:end].view(v_shape) for v in cache.v], [c[first:end] for c in cache.centroids],
                   packed)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor) -> None:
        """Copy layer `layer`'s prompt keys/values [Hkv, tokens, D] and page centroids in."""
        self.k[layer].copy_(pack_keys(k) if self.packed else k)
        self.v[layer].copy_(pack_values(v) if self.packed else v)
        self.centroids[layer].copy_(centroids)


class PrefixStore:
    """The cascade's prompt copies of one engine run (CPU), by request id.

    `take` makes a group's copy at its prefill, in pool pages with consecutive ids held by the block
    manager, while that leaves each of its samples that can run at once a page to grow into; `release`
    counts the group's samples out and gives the pages back after the last. The block manager may
    reclaim a copy's pages before it preempts anyone: its samples then read the same keys through their
    block tables."""

    def __init__(self, blocks: BlockManager, cache: PagedKVCache, packed: bool):
        self.blocks, self.cache, self.packed = blocks, cache, packed
        self._prefixes: dict[int, SharedPrefix] = {}
        self._unfinished: dict[int, int] = {}  # request id -> samples not finished

    @property
    def prefixes(self) -> dict[int, SharedPrefix]:
        """The copies whose pages are still held, by request id."""
        return {rid: p for rid, p in self._prefixes.items() if rid in self.blocks.held}

    def take(self, request_id: int, pages: list[int], samples: int, running: int) -> SharedPrefix | None:
        """A copy of `pages` for the request's `samples`, of which at most `running` run at once."""
        m = len(pages)
        if m == 0 or self.blocks.num_free - m < running:
            return None
        run = self.blocks.hold_run(request_id, m)
        if run is None:
            return None
        prefix = SharedPrefix.in_pool(self.cache, pages, run, self.packed)
        self._prefixes[request_id] = prefix
        self._unfinished[request_id] = samples
        return prefix

    def release(self, request_id: int) -> None:
        """One sample of the request finished."""
        if request_id in self._unfinished:
            self._unfinished[request_id] -= 1
            if self._unfinished[request_id] == 0:
                self._drop(request_id)

    def _drop(self, request_id: int) -> None:
        del self._unfinished[request_id], self._prefixes[request_id]
        self.blocks.release(request_id)
