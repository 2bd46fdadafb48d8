"""Paged KV storage: one tensor per kind for all layers, indexed by physical page.

Layout per layer (the kernels' contract, kernels/CONTRACT.md): `k[l]`, `v[l]` are
[num_pages, Hkv, P, D] in the model dtype and `centroids[l]` is [num_pages, Hkv, D] float32 (bf16 where
the runner asks for it), the mean of the post-RoPE keys written so far into the page. Keeping all layers
in one tensor makes copying a page (a sample's private copy of the prompt's partial last page) one
indexing op for every layer. Memory is zero-initialised (calloc'd on the CPU, so untouched pages cost
no resident memory).

Under an eviction policy the pool also holds the query ring the compressions read (`queries`, [layers,
slots x window + 1, Hq, D] in the model dtype: `window` rows per running sample and a last row that
padding rows and samples that evict nothing write to; compaction.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparrow.kernels.cpu_attention import pack_keys, pack_values, packed_key_shape, packed_value_shape

from ..model.config import ModelConfig


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, centroid_dtype: torch.dtype = torch.float32):
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.centroids = torch.zeros(shape[:3] + (cfg.head_dim,), dtype=centroid_dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size
        self.cfg = cfg
        self.queries: torch.Tensor | None = None
        self.window = 0

    def add_query_ring(self, slots: int, window: int) -> None:
        """Room for `window` queries per layer of `slots` running samples (replaces a smaller ring)."""
        cfg = self.cfg
        self.queries = None
        self.queries = torch.zeros(cfg.num_layers, slots * window + 1, cfg.num_heads, cfg.head_dim,
                                   dtype=self.k.dtype, device=self.k.device)
        self.window = window

    @staticmethod
    def query_ring_bytes(cfg: ModelConfig, slots: int, window: int, dtype: torch.dtype) -> int:
        if not window:
            return 0
        elem = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_layers * (slots * window + 1) * cfg.num_heads * cfg.head_dim * elem

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i], self.centroids[i]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (keys, values, centroids) in every layer."""
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
        self.centroids[:, d] = self.centroids[:, s]

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype,
                       centroid_dtype: torch.dtype = torch.float32) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        cent = torch.tensor([], dtype=centroid_dtype).element_size()
        return cfg.num_layers * cfg.num_kv_heads * (2 * page_size * elem + cent) * cfg.head_dim


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
    packed: bool = False  # k and v in the AVX512-BF16 kernel's layouts (kernels/cpu_attention.py)

    @classmethod
    def in_pool(cls, cache: PagedKVCache, pages: list[int], run: list[int],
                packed: bool = False) -> SharedPrefix:
        """The store of prompt `pages` in the pool pages `run` (consecutive ids, as many as `pages`)."""
        assert len(run) == len(pages) and run == list(range(run[0], run[0] + len(run)))
        first, end = run[0], run[0] + len(run)
        hkv, size, d = cache.k.shape[2:]
        tokens = len(run) * size
        k_shape = packed_key_shape(hkv, tokens, d) if packed else (hkv, tokens, d)
        v_shape = packed_value_shape(hkv, tokens, d) if packed else (hkv, tokens, d)
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

    def __init__(self, blocks, cache: PagedKVCache, packed: bool):
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


def upload(device: torch.device, values, dtype: torch.dtype) -> torch.Tensor:
    """Host values (a list, nested lists or an array) on the device without waiting for the device: through
    pinned memory on CUDA, so a copy issued while a decode step is in flight does not wait for it."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
