"""Dense paged decode attention (the baseline): exact softmax attention of one query token per request
over all of its cached tokens, read through the block table.

out[b, hq] = softmax(scale * q[b, hq] . K^T) V over positions 0..seq_lens[b]-1 (logical pages
0..n_pages-1), GQA: query head hq uses KV head hq // (Hq // Hkv). The Triton path is the flash-decoding
kernel of `sparse_decode` with DENSE=True: grid (B, Hkv, splits) where each split owns a contiguous
range of logical pages (the KV length is split), each program processes all query heads of its KV head's
group so every K/V page is loaded once per group, and programs whose range lies past the request's
length exit without work; partial (max, sum, acc) are merged by the same reduce kernel. With `groups`
(a speculative cycle's verification: the fed tokens of one sequence are consecutive rows, each a query
whose cache ends at its own position) a program takes a group's queries together, so the sequence's
pages are read once for all of them; the reference needs no groups (each row is its own query).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sparse_decode import GatherWorkspace, _attend_pages_reference, paged_decode_triton


def dense_decode_reference(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                           seq_lens: Tensor, scale: float | None = None,
                           workspace: GatherWorkspace | None = None) -> Tensor:
    """dense_paged_attention in torch: every logical page of the block table, positions < seq_len."""
    b, hkv, max_pages = q.shape[0], k_pages.shape[1], block_table.shape[1]
    pages = torch.arange(max_pages, device=q.device, dtype=torch.long).expand(b, hkv, max_pages)
    return _attend_pages_reference(q, k_pages, v_pages, block_table, seq_lens, pages, scale, workspace)


def dense_decode_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                        seq_lens: Tensor, scale: float | None = None, num_splits: int | None = None,
                        block_n: int | None = None, num_warps: int = 4, groups: Tensor | None = None,
                        queries_per_group: int = 1) -> Tensor:
    """dense_paged_attention in Triton (flash-decoding, split over the KV length); with `groups`, the
    consecutive rows of one sequence read its pages once (`paged_decode_triton`)."""
    return paged_decode_triton(q, k_pages, v_pages, block_table, seq_lens, None, scale,
                               num_splits=num_splits, block_n=block_n, num_warps=num_warps, groups=groups,
                               queries_per_group=queries_per_group)
