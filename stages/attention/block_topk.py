"""The block top-k page-selection rule, vectorised over requests, KV heads and query positions.

For a query at position t the cache holds positions 0..t in pages of `page` tokens; the last page
L = t // page may be partial. Pages 0 (sink), L-1 and L (local) are always kept. Every other page
1..L-2 is complete and is scored by mean(query heads of the group) . centroid; the best
budget/page - 3 are kept. When all pages fit the budget, the rule keeps everything (dense), which
falls out of the same top-k because there are no more candidates than slots. A budget of 0 means
dense. The decode path and the teacher-forced path both call `kept_page_mask`, so they cannot
disagree about the rule; the tests check it against a one-position-at-a-time brute force.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.definitions import PAGE_SIZE, RESERVED_PAGES


def page_centroids(keys: Tensor, page: int = PAGE_SIZE) -> Tensor:
    """keys [B, Hkv, S, D] -> mean key of each page [B, Hkv, ceil(S/page), D] (last may be partial)."""
    b, h, s, d = keys.shape
    n = -(-s // page)
    padded = torch.nn.functional.pad(keys, (0, 0, 0, n * page - s))
    sums = padded.view(b, h, n, page, d).sum(3)
    counts = torch.full((n,), page, dtype=keys.dtype, device=keys.device)
    counts[-1] = s - (n - 1) * page
    return sums / counts[:, None]


def kept_page_mask(q: Tensor, centroids: Tensor, positions: Tensor, budgets: Tensor,
                   page: int = PAGE_SIZE) -> Tensor:
    """Which pages each query keeps.

    q [B, Hq, T, D] post-RoPE queries; centroids [B, Hkv, P, D]; positions [B, T] (query position,
    the cache holds 0..position); budgets [B, T] in tokens (0 = dense).
    Returns bool [B, Hkv, T, P]; pages beyond a query's last page are False.
    """
    b, hq, t, d = q.shape
    hkv, n_pages = centroids.shape[1], centroids.shape[2]
    q_mean = q.view(b, hkv, hq // hkv, t, d).mean(2)  # [B, Hkv, T, D]
    scores = q_mean @ centroids.transpose(-1, -2)  # [B, Hkv, T, P]
    page_idx = torch.arange(n_pages, device=q.device)
    last = (positions // page)[:, None, :, None]  # [B, 1, T, 1]
    candidate = (page_idx >= 1) & (page_idx <= last - 2)
    reserved = (page_idx == 0) | ((page_idx >= last - 1) & (page_idx <= last))
    n_select = torch.where(budgets > 0, budgets // page - RESERVED_PAGES, n_pages)  # [B, T]
    k = int(min(n_pages, max(int(n_select.max()), 0)))
    if k == 0:
        return reserved.expand(b, hkv, t, n_pages).clone()
    scores = scores.masked_fill(~candidate, float("-inf"))
    top = scores.topk(k, dim=-1).indices  # [B, Hkv, T, k]
    rank_ok = torch.arange(k, device=q.device) < n_select[:, None, :, None]  # [B, 1, T, k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, rank_ok.expand_as(top))
    return reserved | (chosen & candidate)


def kept_token_mask(pages: Tensor, positions: Tensor, kv_len: int, page: int = PAGE_SIZE) -> Tensor:
    """Page mask [B, Hkv, T, P] -> causal token mask [B, Hkv, T, kv_len]."""
    tokens = pages.repeat_interleave(page, dim=-1)[..., :kv_len]
    causal = torch.arange(kv_len, device=pages.device) <= positions[:, None, :, None]
    return tokens & causal
