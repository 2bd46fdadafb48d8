"""Page scoring and block top-k page selection over a paged KV cache (the selection half of sparse decode).

For each request b and KV head h at a decode step with cache length seq_len (positions 0..t, t = seq_len-1,
last = t // P), score every candidate page j in 1..last-2 as mean(query heads of h's group) . centroid of
the physical page block_table[b, j]; non-candidates score -inf. The selection keeps pages 0, last-1, last
and the best budget/P - 3 candidates (all pages when budget == 0 or n_pages <= budget/P) and returns their
LOGICAL indices sorted ascending, padded with -1, [B, Hkv, K] with K = max kept over the batch (or
`max_selected` when given, which avoids a device-to-host sync, e.g. under CUDA graphs).

Two Triton kernels, each sized by the rows' real lengths, not the table's width (the grid is the
table's, so a CUDA graph captured for the widest table stays valid; programs past a row's pages exit).
The scoring kernel, grid (B, Hkv, page blocks): each program whose block holds candidate pages averages
the group's query heads once (group padded to a power of two with masks), gathers BLOCK_P centroids
(fp32 or bf16) through the block table and writes BLOCK_P fp32 scores. The selection kernel, grid
(B, Hkv), does in one program per row what the torch reference does with topk, masks and a sort: it maps
the row's scores to order-preserving 32-bit keys and finds the n-th largest by a radix select, 8 bits
per pass (four passes, each a histogram of one digit over the candidates that agree with the digits
found so far; the first pass also counts the candidates, and with no more of them than the budget
keeps the other passes from reading anything), keeps the keys above it and, of the keys equal to it,
the lowest page indices first, adds the reserved pages, and writes the kept pages in index order by a
prefix sum carried across chunks of the row. Ties are the only place it may differ from torch.topk,
whose order among equal scores is unspecified; the tests hold it to the lowest-index rule exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.stages.core.definitions import RESERVED_PAGES  # the sink page and the two most recent

from ._triton_utils import lazy_jit, next_pow2, require_triton

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)


def page_scores_reference(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                          page_size: int = 16) -> Tensor:
    """[B, Hkv, max_pages] fp32 scores; -inf for pages that are not candidates (0, last-1, last, beyond)."""
    b, hq, d = q.shape
    hkv = centroids.shape[1]
    q_mean = q.float().view(b, hkv, hq // hkv, d).mean(2)  # [B, Hkv, D]
    cent = centroids[block_table.long().clamp(min=0)].float()  # [B, max_pages, Hkv, D]
    return mask_candidates(torch.einsum("bhd,bphd->bhp", q_mean, cent), block_table, seq_lens, page_size)


@dataclass
class SelectionPlan:
    """What selection derives from a decode step's lengths, budgets and block table alone, which every
    sparse layer of the step shares; the engine's CPU path builds it once per step (about twenty small
    ops per layer otherwise). page_idx [max_pages]; candidate [B, 1, max_pages] (pages 1..last-2);
    reserved [B, 1, max_pages] (pages 0, last-1, last that exist); n_select [B, 1, 1] candidates to keep;
    k_top its maximum (bounded by max_pages); unscored [B, 1, max_pages] the pages whose score is -inf
    (not candidates, or absent from the block table), when built with the block table."""

    page_idx: Tensor
    candidate: Tensor
    reserved: Tensor
    n_select: Tensor
    k_top: int
    unscored: Tensor | None = None


def plan_selection(seq_lens: Tensor, budgets: Tensor, page_size: int, max_pages: int,
                   max_selected: int | None = None, block_table: Tensor | None = None) -> SelectionPlan:
    page_idx = torch.arange(max_pages, device=seq_lens.device)
    seq_lens, budgets = seq_lens.long(), budgets.long()
    last = ((seq_lens - 1) // page_size)[:, None, None]  # [B, 1, 1]
    n_pages = ((seq_lens + page_size - 1) // page_size)[:, None, None]
    candidate = (page_idx >= 1) & (page_idx <= last - 2)
    reserved = ((page_idx == 0) | ((page_idx >= last - 1) & (page_idx <= last))) & (page_idx < n_pages)
    n_select = torch.where(budgets > 0, budgets // page_size - RESERVED_PAGES, max_pages).clamp(min=0)
    if max_selected is None:
        k_top = int(min(max_pages, int(n_select.max()))) if len(n_select) else 0
    else:
        k_top = min(max_pages, max_selected)
    unscored = None if block_table is None else ~(candidate & (block_table.long() >= 0)[:, None, :])
    return SelectionPlan(page_idx, candidate, reserved, n_select[:, None, None], k_top, unscored)


def mask_candidates(scores: Tensor, block_table: Tensor, seq_lens: Tensor, page_size: int,
                    plan: SelectionPlan | None = None) -> Tensor:
    """Scores [B, Hkv, max_pages] with -inf where a page is not a candidate (0, last-1, last, beyond)."""
    if plan is None or plan.unscored is None:
        page_idx = torch.arange(scores.shape[2], device=scores.device)
        last = ((seq_lens.long() - 1) // page_size)[:, None, None]
        candidate = (page_idx >= 1) & (page_idx <= last - 2) & (block_table.long() >= 0)[:, None, :]
        return scores.masked_fill(~candidate, float("-inf"))
    return scores.masked_fill(plan.unscored, float("-inf"))


def finish_selection(scores: Tensor, seq_lens: Tensor, budgets: Tensor, page_size: int = 16,
                     max_selected: int | None = None, plan: SelectionPlan | None = None) -> Tensor:
    """Scores [B, Hkv, max_pages] (-inf = not a candidate) -> selected logical pages [B, Hkv, K].
    `plan`: this step's `plan_selection`, reused across layers."""
    b, hkv, max_pages = scores.shape
    plan = plan or plan_selection(seq_lens, budgets, page_size, max_pages, max_selected)
    kept = plan.reserved.expand(b, hkv, max_pages)
    if plan.k_top > 0:
        top = scores.topk(plan.k_top, dim=-1).indices  # [B, Hkv, k_top]
        rank_ok = torch.arange(plan.k_top, device=scores.device) < plan.n_select
        chosen = torch.zeros_like(kept).scatter_(-1, top, rank_ok.expand_as(top))
        kept = kept | (chosen & plan.candidate & (scores > float("-inf")))
    if max_selected is None:
        width = int(kept.sum(-1).max()) if b else 0
    else:
        width = max_selected
    order = torch.where(kept, plan.page_idx, max_pages)
    if width <= max_pages:
        order = order.sort(dim=-1).values[..., :width]
    else:
        order = torch.nn.functional.pad(order.sort(dim=-1).values, (0, width - max_pages), value=max_pages)
    return torch.where(order == max_pages, -1, order).to(torch.int32)


def page_scoring_reference(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                           budgets: Tensor, page_size: int = 16, max_selected: int | None = None) -> Tensor:
    """select_pages in torch: [B, Hkv, K] int32 logical pages, sorted, padded with -1."""
    scores = page_scores_reference(q, centroids, block_table, seq_lens, page_size)
    return finish_selection(scores, seq_lens, budgets, page_size, max_selected)


def _page_scores_kernel(q, centroids, block_table, seq_lens, scores,
                        s_qb, s_qh, s_c0, s_c1, s_bt0, s_sb, s_sh, max_pages,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK_P: tl.constexpr, FILL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    in_table = p < max_pages
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    last = (seq_len - 1) // PAGE
    out = scores + b * s_sb + h * s_sh + p
    if pb * BLOCK_P <= last - 2:  # the block holds a candidate page (1..last-2): score it
        d = tl.arange(0, BLOCK_D)
        g = tl.arange(0, BLOCK_G)
        dm = d < D
        qg = tl.load(q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :],
                     mask=(g < G)[:, None] & dm[None, :], other=0.0).to(tl.float32)
        q_mean = tl.sum(qg, axis=0) / G  # [BLOCK_D]
        cand = in_table & (p >= 1) & (p <= last - 2)
        phys = tl.load(block_table + b * s_bt0 + p, mask=cand, other=-1).to(tl.int64)
        cand = cand & (phys >= 0)
        cent = tl.load(centroids + phys[:, None] * s_c0 + h * s_c1 + d[None, :],
                       mask=cand[:, None] & dm[None, :], other=0.0).to(tl.float32)
        s = tl.sum(cent * q_mean[None, :], axis=1)
        tl.store(out, tl.where(cand, s, float("-inf")), mask=in_table)
    elif FILL:  # past the row's candidates: -inf without reading anything
        tl.store(out, tl.full([BLOCK_P], float("-inf"), tl.float32), mask=in_table)


_page_scores_jit = lazy_jit(_page_scores_kernel)


def page_scores_triton(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                       page_size: int = 16, block_p: int = 64, num_warps: int = 4,
                       fill: bool = True) -> Tensor:
    """[B, Hkv, max_pages] fp32 scores. Programs whose pages lie past the row's candidates read nothing;
    `fill`: they still write -inf there (the `page_scores` op's contract); without it the scores past
    each row's candidates are left unwritten, which the selection kernel never reads."""
    require_triton()
    b, hq, d = q.shape
    hkv = centroids.shape[1]
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    max_pages = block_table.shape[1]
    scores = torch.empty(b, hkv, max_pages, device=q.device, dtype=torch.float32)
    if b == 0 or max_pages == 0:
        return scores
    q = q if q.stride(2) == 1 else q.contiguous()
    assert centroids.stride(2) == 1, "centroids must be contiguous in the head dim"
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    block_p = min(block_p, next_pow2(max_pages))
    grid = (b, hkv, triton_cdiv(max_pages, block_p))
    _page_scores_jit[grid](
        q, centroids, block_table, seq_lens, scores,
        q.stride(0), q.stride(1), centroids.stride(0), centroids.stride(1), block_table.stride(0),
        scores.stride(0), scores.stride(1), max_pages,
        D=d, BLOCK_D=next_pow2(d), G=hq // hkv, BLOCK_G=next_pow2(hq // hkv), PAGE=page_size,
        BLOCK_P=block_p, FILL=fill, num_warps=num_warps,
    )
    return scores


def _select_kernel(scores, seq_lens, budgets, selected, counts, s_sb, s_sh, s_ob, s_oh, max_pages, width,
                   PAGE: tl.constexpr, RESERVED: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    budget = tl.load(budgets + b).to(tl.int32)
    n_pages = (seq_len + PAGE - 1) // PAGE
    last = n_pages - 1
    n_read = tl.minimum(n_pages, max_pages)  # the row's own pages: nothing past them is read
    cand_end = tl.minimum(tl.maximum(last - 1, 0), max_pages)  # candidates: pages 1..last-2
    n_sel = tl.maximum(tl.where(budget > 0, budget // PAGE - RESERVED, max_pages), 0)
    row = scores + b * s_sb + h * s_sh
    lane = tl.arange(0, BLOCK_P)
    bins = tl.arange(0, 256)
    # Radix select of the n_sel-th largest key, 8 bits a pass from the top: each pass histograms the
    # digit of the candidates that agree with the digits found so far and finds the digit at which the
    # count from the top reaches the number still needed. Keys: fp32 -> int32 of the same order
    # (negatives: magnitude bits flipped) -> [0, 2^32) in int64. Pass 1 also counts the candidates: with
    # no more than n_sel of them every candidate is kept and the other passes read nothing.
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, cand_end, BLOCK_P):
        p = start + lane
        s = tl.load(row + p, mask=(p >= 1) & (p < cand_end), other=float("-inf"))
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
        hist += tl.histogram(((key >> 24) & 255).to(tl.int32), 256, mask=s > float("-inf"))
    count_ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # candidates with a digit >= bin
    search = tl.sum(hist, axis=0) > n_sel
    need = tl.where(search, n_sel, 0)
    top = tl.sum((count_ge >= need).to(tl.int32), axis=0) - 1
    prefix = tl.where(search, top.to(tl.int64) << 24, 0)
    need = need - tl.sum(tl.where(bins == top, count_ge - hist, 0), axis=0)
    hi = tl.where(search, cand_end, 0)
    for i in tl.static_range(1, 4):
        shift = 24 - 8 * i  # a constant: i is unrolled
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, hi, BLOCK_P):
            p = start + lane
            s = tl.load(row + p, mask=(p >= 1) & (p < hi), other=float("-inf"))
            bits = s.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
            match = (s > float("-inf")) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        count_ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.sum((count_ge >= need).to(tl.int32), axis=0) - 1
        prefix = tl.where(search, prefix | (digit.to(tl.int64) << shift), prefix)
        need = tl.where(search, need - tl.sum(tl.where(bins == digit, count_ge - hist, 0), axis=0), need)
    # keep the keys above the threshold and, of those equal to it, the `need` lowest pages; add the
    # reserved pages; write the kept pages in index order (running prefix sums across the chunks)
    base = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    out = selected + b * s_ob + h * s_oh
    for start in range(0, n_read, BLOCK_P):
        p = start + lane
        in_row = p < n_read
        s = tl.load(row + p, mask=(p >= 1) & (p < cand_end), other=float("-inf"))
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
        cand = s > float("-inf")
        above = cand & (key > prefix)
        tie = cand & (key == prefix) & search
        tie_i = tie.to(tl.int32)
        chosen = above | (tie & (ties + tl.cumsum(tie_i, axis=0) <= need))
        reserved = ((p == 0) | ((p >= last - 1) & (p <= last))) & in_row
        kept_i = (chosen | reserved).to(tl.int32)
        pos = base + tl.cumsum(kept_i, axis=0) - 1
        tl.store(out + pos, p, mask=(kept_i > 0) & (pos < width))
        base += tl.sum(kept_i, axis=0)
        ties += tl.sum(tie_i, axis=0)
    for start in range((tl.minimum(base, width) // BLOCK_W) * BLOCK_W, width, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        tl.store(out + w, tl.full([BLOCK_W], -1, tl.int32), mask=(w >= base) & (w < width))
    tl.store(counts + b * tl.num_programs(1) + h, base)


_select_jit = lazy_jit(_select_kernel)


def select_from_scores_triton(scores: Tensor, seq_lens: Tensor, budgets: Tensor, page_size: int = 16,
                              max_selected: int | None = None) -> Tensor:
    """`finish_selection` in one Triton kernel: scores [B, Hkv, max_pages] -> selected [B, Hkv, K]. Each
    row reads its own pages' scores only (ceil(seq_len / P) of them), whatever the table's width."""
    require_triton()
    b, hkv, max_pages = scores.shape
    width = max_pages if max_selected is None else max_selected
    selected = torch.empty(b, hkv, width, device=scores.device, dtype=torch.int32)
    counts = torch.empty(b, hkv, device=scores.device, dtype=torch.int32)
    if b == 0 or width == 0 or max_pages == 0:
        return selected.fill_(-1)
    assert scores.stride(2) == 1, "scores must be contiguous along the pages"
    _select_jit[(b, hkv)](
        scores, seq_lens.contiguous(), budgets.contiguous(), selected, counts,
        scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1), max_pages, width,
        PAGE=page_size, RESERVED=RESERVED_PAGES, BLOCK_P=min(SELECT_BLOCK, next_pow2(max_pages)),
        BLOCK_W=min(SELECT_BLOCK, next_pow2(width)), num_warps=SELECT_WARPS,
    )
    if max_selected is None:  # as narrow as the widest row, like the reference (a host sync)
        selected = selected[..., : int(counts.max())]
    return selected


SELECT_BLOCK = 1024  # pages per chunk of the selection kernel's passes
SELECT_WARPS = 4  # warps per (sample, KV head) program (bench/kernel_times.py --part select-sweep: others)


def page_scoring_triton(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                        budgets: Tensor, page_size: int = 16, max_selected: int | None = None) -> Tensor:
    """select_pages in Triton: the scoring kernel (rows' candidate pages only), then the selection kernel."""
    scores = page_scores_triton(q, centroids, block_table, seq_lens, page_size, fill=False)
    return select_from_scores_triton(scores, seq_lens, budgets, page_size, max_selected)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
