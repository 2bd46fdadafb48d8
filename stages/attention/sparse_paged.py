"""Teacher-forced block top-k attention on the Triton kernels (CUDA, or the interpreter).

Every query position of a teacher-forced sequence selects its own pages: its cache is the sequence's
positions 0..position, its kept pages are chosen by the engine's selection kernels (the same block top-k
rule as `block_topk.kept_page_mask`, so profiles score what decode selects), read through a block table
over the sequence's page centroids. The attention is the block-sparse prefill kernel
(kernels/sparse_prefill.py): a tile of consecutive positions reads each key block once for all its
queries, each masked to its own kept pages, so no mask over the prefix exists and the reads do not grow
with positions x budget. Queries run in chunks of thousands, sized so that the [chunk, Hkv, pages] fp32
page scores stay bounded, and nothing in the loop reads a value back from the device: the selection's
width is a host-side bound the caller gives. `sparse.block_topk_sdpa` is the torch reference this path
must agree with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.kernels.ops import TRITON, Backend, ops_for
from sparrow.kernels.sparse_prefill import kept_page_bitmap

from ..core.definitions import PAGE_SIZE, RESERVED_PAGES

# bounds the [chunk, Hkv, pages] fp32 page scores of one launch (256 MiB; 4,096 queries of 8 KV heads at
# 2,048 pages, a 32K-token sequence)
SCORE_ELEMENTS = 1 << 26


def paged_scoring_usable(device: torch.device) -> bool:
    """Whether teacher-forced sparse attention on `device` runs the Triton kernels (CUDA with triton, the
    backend `ops_for` picks there) rather than the torch reference."""
    return ops_for(device).backend == Backend.TRITON


def centroid_pages(centroids: Tensor) -> tuple[Tensor, int]:
    """centroids [B, Hkv, n, D] -> ([N, Hkv, D], pages_per_sequence): page j of sequence b is page
    b * pages_per_sequence + j (a view)."""
    b, h, n, d = centroids.shape
    centroids = centroids.contiguous()
    per_sequence = h * n
    return centroids.as_strided(((b - 1) * per_sequence + n, h, d), (d, n * d, 1)), per_sequence


def kept_width(n_pages: int, widest: int | None) -> int:
    """Slots of each query's selected-page list: every page when some query is dense (`widest` None),
    else the widest budget's pages (at least the reserved ones), never more than the sequence has."""
    if widest is None:
        return n_pages
    return min(n_pages, max(widest, RESERVED_PAGES))


def block_topk_paged(q: Tensor, keys: Tensor, values: Tensor, centroids: Tensor, positions: Tensor,
                     budgets: Tensor, widest: int | None, page: int = PAGE_SIZE,
                     score_elements: int = SCORE_ELEMENTS) -> Tensor:
    """`block_topk_sdpa` on the Triton kernels -> [B, Hq, T, D] in q's dtype.

    q [B, Hq, T, D]; keys, values [B, Hkv, S, D] (position s at index s); centroids [B, Hkv,
    ceil(S/page), D]; positions, budgets [B, T] (0 = dense). `widest`: a bound, in pages, on the pages
    any query keeps (its largest budget / page), or None when some query is dense."""
    b, hq, t, d = q.shape
    hkv = keys.shape[1]
    cents, per_sequence = centroid_pages(centroids)
    n_pages = centroids.shape[2]
    width = kept_width(n_pages, widest)
    chunk = max(1, min(t, score_elements // (hkv * n_pages)))
    positions = positions.to(torch.int32)
    seq_lens = positions + 1
    budgets = budgets.to(torch.int32)
    pages = torch.arange(n_pages, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    for i in range(b):
        table = (pages + i * per_sequence).expand(chunk, n_pages).contiguous()  # every query: all pages
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            rows = q[i, :, lo:hi].transpose(0, 1)  # [C, Hq, D]: one query per position
            selected = TRITON.select_pages(rows, cents, table[: hi - lo], seq_lens[i, lo:hi],
                                           budgets[i, lo:hi], page, width)
            kept = kept_page_bitmap(selected, n_pages)  # [C, Hkv, n_pages]
            attended = TRITON.sparse_prefill_attention(rows, keys[i], values[i], positions[i, lo:hi], kept,
                                                       page)
            out[i, :, lo:hi] = attended.transpose(0, 1)
    return out
