"""Paged KV storage: one tensor per kind for all layers, indexed by physical page.

Layout per layer (the kernels' contract, kernels/CONTRACT.md): `k[l]`, `v[l]` are
[num_pages, Hkv, P, D] in the model dtype and `centroids[l]` is [num_pages, Hkv, D] float32, the mean
of the post-RoPE keys written so far into the page. Keeping all layers in one tensor makes copying a
page (a sample's private copy of the prompt's partial last page) one indexing op for every layer.
Memory is zero-initialised (calloc'd on the CPU, so untouched pages cost no resident memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import ModelConfig


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.centroids = torch.zeros(shape[:3] + (cfg.head_dim,), dtype=torch.float32, device=device)
        self.num_pages, self.page_size = num_pages, page_size

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
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_layers * cfg.num_kv_heads * (2 * page_size * elem + 4) * cfg.head_dim


@dataclass
class SharedPrefix:
    """The full prompt pages that the samples of one request share, with a contiguous copy of their
    keys, values and centroids taken at prefill, which cascade attention and page scoring read once
    per decode step for all the samples whose block table starts with `pages`
    (kernels/cascade_decode.py). Full prompt pages are never written again, so the copy stays exact."""

    pages: tuple[int, ...]
    k: torch.Tensor  # [L, Hkv, len(pages) * P, D] model dtype
    v: torch.Tensor
    centroids: torch.Tensor  # [L, len(pages), Hkv, D] float32

    @classmethod
    def allocate(cls, cfg: ModelConfig, pages: list[int], page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> SharedPrefix:
        shape = (cfg.num_layers, cfg.num_kv_heads, len(pages) * page_size, cfg.head_dim)
        cent = (cfg.num_layers, len(pages), cfg.num_kv_heads, cfg.head_dim)
        return cls(tuple(pages), torch.empty(shape, dtype=dtype, device=device),
                   torch.empty(shape, dtype=dtype, device=device),
                   torch.empty(cent, dtype=torch.float32, device=device))

    @property
    def tokens(self) -> int:
        return self.k.shape[2]
