"""Teacher-forced block top-k attention through the paged decode kernels (Triton: CUDA, or the interpreter).

Every query position of a teacher-forced sequence is a decode query of its own: its cache is the
sequence's positions 0..position, its kept pages are chosen by the engine's selection kernels (the same
block top-k rule as `block_topk.kept_page_mask`) and attended by the sparse paged decode kernel. The
sequence's contiguous keys/values [B, Hkv, S, D] are read in place as pages (a strided view; a padded
copy when S is not a multiple of the page size or the layout does not allow the view), so no mask over
the prefix exists; every query row shares its sequence's block table. Queries run in chunks of
thousands, sized so that the [chunk, Hkv, pages] fp32 page scores stay bounded, and nothing in the loop
reads a value back from the device: the selection's width is a host-side bound the caller gives.
`sparse.block_topk_sdpa` is the torch reference this path must agree with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparrow.kernels.ops import TRITON, Backend, ops_for

from ..core.definitions import PAGE_SIZE, RESERVED_PAGES

# bounds the [chunk, Hkv, pages] fp32 page scores of one launch (256 MiB; 4,096 queries of 8 KV heads at
# 2,048 pages, a 32K-token sequence)
SCORE_ELEMENTS = 1 << 26


def paged_scoring_usable(device: torch.device) -> bool:
    """Whether teacher-forced sparse attention on `device` runs the paged Triton kernels (CUDA with
    triton, the backend `ops_for` picks there) rather than the torch reference."""
    return ops_for(device).backend == Backend.TRITON


def as_pages(x: Tensor, page: int = PAGE_SIZE) -> tuple[Tensor, int]:
    """x [B, H, S, D] -> (pages [N, H, page, D], pages_per_sequence): page j of sequence b is page
    b * pages_per_sequence + j. A view of x when S is a multiple of the page size and x is contiguous,
    else of a zero-padded copy."""
    b, h, s, d = x.shape
    n = -(-s // page)
    if s % page or not x.is_contiguous():
        x = F.pad(x, (0, 0, 0, n * page - s)).contiguous()
    per_sequence = h * n
    pages = x.as_strided(((b - 1) * per_sequence + n, h, page, d), (page * d, n * page * d, d, 1))
    return pages, per_sequence


def centroid_pages(centroids: Tensor, per_sequence: int) -> Tensor:
    """centroids [B, Hkv, n, D] -> [N, Hkv, D] indexed by the page ids of `as_pages` (same layout)."""
    b, h, n, d = centroids.shape
    assert per_sequence == h * n, "centroids and pages disagree on the number of pages"
    centroids = centroids.contiguous()
    return centroids.as_strided(((b - 1) * per_sequence + n, h, d), (d, n * d, 1))


def kept_width(n_pages: int, widest: int | None) -> int:
    """Slots of each query's selected-page list: every page when some query is dense (`widest` None),
    else the widest budget's pages (at least the reserved ones), never more than the sequence has."""
    if widest is None:
        return n_pages
    return min(n_pages, max(widest, RESERVED_PAGES))


def block_topk_paged(q: Tensor, keys: Tensor, values: Tensor, centroids: Tensor, positions: Tensor,
                     budgets: Tensor, widest: int | None, page: int = PAGE_SIZE,
                     score_elements: int = SCORE_ELEMENTS) -> Tensor:
    """`block_topk_sdpa` through the paged decode kernels -> [B, Hq, T, D] in q's dtype.

    q [B, Hq, T, D]; keys, values [B, Hkv, S, D] (position s at index s); centroids [B, Hkv,
    ceil(S/page), D]; positions, budgets [B, T] (0 = dense). `widest`: a bound, in pages, on the pages
    any query keeps (its largest budget / page), or None when some query is dense."""
    b, hq, t, d = q.shape
    hkv = keys.shape[1]
    k_pages, per_sequence = as_pages(keys, page)
    v_pages, _ = as_pages(values, page)
    cents = centroid_pages(centroids, per_sequence)
    n_pages = centroids.shape[2]
    width = kept_width(n_pages, widest)
    chunk = max(1, min(t, score_elements // (hkv * n_pages)))
    seq_lens = (positions + 1).to(torch.int32)
    budgets = budgets.to(torch.int32)
    pages = torch.arange(n_pages, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    for i in range(b):
        table = (pages + i * per_sequence).expand(chunk, n_pages).contiguous()  # every query: all pages
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            rows = q[i, :, lo:hi].transpose(0, 1)  # [C, Hq, D]: one decode query per position
            lens, block_table = seq_lens[i, lo:hi], table[: hi - lo]
            selected = TRITON.select_pages(rows, cents, block_table, lens, budgets[i, lo:hi], page, width)
            attended = TRITON.sparse_paged_attention(rows, k_pages, v_pages, block_table, lens, selected)
            out[i, :, lo:hi] = attended.transpose(0, 1)
    return out
