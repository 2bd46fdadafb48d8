"""Paged KV storage: one tensor per kind for all layers, indexed by physical page (kernels/CONTRACT.md).

`k[l]`, `v[l]` are [num_pages, Hkv, P, D] in the model dtype, `centroids[l]` [num_pages, Hkv, D] (the mean
of the post-RoPE keys written into the page); one tensor for all layers makes a page copy one indexing
op. Zero-initialised (filled, so resident, when made). Under an eviction policy the pool also holds the
query ring the compressions read (`queries`, compaction.py).
"""

from __future__ import annotations

import numpy as np
import torch

from sparrow.kernels.append_kv import set_page_means

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

    def recompute_centroids(self, pages: list[int], filled: list[int]) -> None:
        """Each page's centroids, in every layer, as the mean of its first filled[i] slots' keys (after the
        slots past them were given up or rewritten: a speculative cycle's drafts), every layer at once."""
        if not pages:
            return
        set_page_means(self.k, self.centroids, upload(self.k.device, pages, torch.long),
                       upload(self.k.device, filled, torch.long))

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype,
                       centroid_dtype: torch.dtype = torch.float32) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        cent = torch.tensor([], dtype=centroid_dtype).element_size()
        return cfg.num_layers * cfg.num_kv_heads * (2 * page_size * elem + cent) * cfg.head_dim


def upload(device: torch.device, values, dtype: torch.dtype) -> torch.Tensor:
    """Host values (a list, nested lists or an array) on the device without waiting for the device: through
    pinned memory on CUDA, so a copy issued while a decode step is in flight does not wait for it."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def pinned_copies(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of device tensors issued without waiting: into pinned memory on CUDA (read them once
    an event recorded after this call has completed), the tensors themselves off CUDA."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(out, tensors):
        host.copy_(t, non_blocking=True)
    return out


def download(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of device tensors, waited for on one event (no stream sync)."""
    out = pinned_copies(*tensors)
    if tensors and tensors[0].device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return out
