"""Sparse paged decode attention: exact softmax attention of one query token per request over the KV
tokens of the selected pages, with a flash-decoding Triton kernel that `dense_decode` shares.

out[b, hq] = softmax(scale * q[b, hq] . K_sel^T) V_sel over the tokens of the logical pages
`selected[b, hq // G]` (sorted, -1 = padding) at positions < seq_lens[b], read through the block table;
G = Hq // Hkv query heads share a KV head (GQA). The Triton kernel runs a grid (B, Hkv, splits), the
number of splits chosen from the table's width (so a CUDA graph captured for the widest table serves
every length); each program owns a contiguous range of the row's own extent, which it computes from
seq_len (the selected-page list, or the logical pages 0..n_pages-1 when dense, divided among the splits),
loads the query heads of its KV head's group as one [BLOCK_G, D] tile (the group padded to a power of
two >= 16 with masks, so each K/V page is read once per group and tl.dot applies), streams BLOCK_N
tokens (BLOCK_N / P pages) per iteration and keeps an online softmax (running max, sum, fp32
accumulator) in base 2. Each split writes its partial (max, sum, acc) to a workspace and a second small
kernel, grid (B, Hq), merges the splits. fp32 inputs use IEEE fp32 dots; bf16 inputs use bf16 dots with
fp32 accumulation (under the interpreter, whose tl.dot mishandles bf16, the same bf16-rounded operands
are upcast to fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton_utils import interpreting, lazy_jit, next_pow2, require_triton

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)

LOG2E = 1.4426950408889634


class GatherWorkspace:
    """Reused destination of the CPU path's K/V gather.

    A CPU decode step gathers tens of MB of K/V per layer. Fresh tensors that large come from new
    mmaps under glibc's defaults, so each step paid a page fault per 4 KiB, measured at about as much
    as the rest of the step (SmolLM2, 6K context, 8 samples: 0.90 s vs 0.41 s). The engine keeps one
    workspace for its lifetime; it grows by a quarter at a time, so a growing context reallocates
    rarely."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def take(self, rows: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Two [rows, P, D] buffers with the dtype and device of `like` [N, P, D]."""
        k = self.keys
        same_kind = (k is not None and k.shape[1:] == like.shape[1:] and k.dtype == like.dtype
                     and k.device == like.device)
        if not same_kind or k.shape[0] < rows:
            n = max(rows, int(1.25 * k.shape[0])) if same_kind else rows
            self.keys = like.new_empty((n, *like.shape[1:]))
            self.values = like.new_empty((n, *like.shape[1:]))
        return self.keys[:rows], self.values[:rows]


@dataclass
class PagePlan:
    """The index work of a page gather, which depends on the pages and the sequence lengths but not on
    the layer: a cascade step gathers the same suffix pages in every layer, so it plans them once.
    rows [B*Hkv*K] into the cache viewed as [pages*Hkv, P, D]; valid [B, Hkv, K*P]; invalid: the flat
    positions to zero; empty [B, Hkv] rows with no valid position; masks: the additive mask per dtype."""

    rows: Tensor
    valid: Tensor
    invalid: Tensor
    empty: Tensor
    masks: dict = field(default_factory=dict)

    def mask(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self.masks:
            self.masks[dtype] = additive_mask(self.valid, dtype)
        return self.masks[dtype]


def additive_mask(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """valid [B, Hkv, S] -> [B, Hkv, 1, S]: 0 where valid, -inf elsewhere (the CPU flash kernel's form)."""
    zeros = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return zeros.masked_fill_(~valid, float("-inf"))[:, :, None, :]


def plan_pages(block_table: Tensor, seq_lens: Tensor, pages: Tensor, hkv: int, page_size: int) -> PagePlan:
    """The `PagePlan` of the logical pages `pages` [B, Hkv, K] (-1 = none)."""
    b, _, n_sel = pages.shape
    device = pages.device
    pages = pages.long()
    phys = torch.gather(block_table.long()[:, None, :].expand(b, hkv, -1), 2, pages.clamp(min=0))
    rows = (phys.clamp(min=0) * hkv + torch.arange(hkv, device=device)[None, :, None]).reshape(-1)
    pos = (pages[..., None] * page_size + torch.arange(page_size, device=device)).reshape(b, hkv, -1)
    valid = ((pages >= 0) & (phys >= 0)).repeat_interleave(page_size, -1)
    valid = valid & (pos < seq_lens.long()[:, None, None])  # [B, Hkv, K*P]
    return PagePlan(rows, valid, (~valid).view(-1).nonzero().squeeze(1), ~valid.any(-1))


def gather_pages(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor,
                 pages: Tensor, workspace: GatherWorkspace | None = None,
                 plan: PagePlan | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The keys and values of the logical pages `pages` [B, Hkv, K] (-1 = none), batched with index
    tensors -> keys, values [B, Hkv, K*P, D] in the cache's dtype (zero at invalid positions),
    valid [B, Hkv, K*P]. A bf16 cache stays bf16: the attention that follows accumulates in fp32 anyway,
    and converting the gathered rows cost a copy of them. `plan`: `plan_pages` of these pages, reused.

    This is the CPU hot path, so it gathers whole (page, KV head) rows with one `index_select`
    (a memcpy per 4 KiB row; advanced indexing is several times slower), into `workspace` when given,
    and zeroes only the value rows and key rows of invalid positions, which unwritten slots need
    (they may hold NaN, and NaN + -inf is NaN) and which are few."""
    b, hkv, n_sel = pages.shape
    total, page_size, d = k_pages.shape[0], k_pages.shape[2], k_pages.shape[3]
    plan = plan or plan_pages(block_table, seq_lens, pages, hkv, page_size)
    k_rows = k_pages.reshape(total * hkv, page_size, d)
    v_rows = v_pages.reshape(total * hkv, page_size, d)
    if workspace is None:
        keys, values = k_rows.index_select(0, plan.rows), v_rows.index_select(0, plan.rows)  # [B*Hkv*K, P, D]
    else:
        keys, values = workspace.take(plan.rows.numel(), k_rows)
        torch.index_select(k_rows, 0, plan.rows, out=keys)
        torch.index_select(v_rows, 0, plan.rows, out=values)
    keys = keys.view(b * hkv * n_sel * page_size, d)
    values = values.view(b * hkv * n_sel * page_size, d)
    keys.index_fill_(0, plan.invalid, 0.0)
    values.index_fill_(0, plan.invalid, 0.0)
    kv_shape = (b, hkv, n_sel * page_size, d)
    return keys.view(kv_shape), values.view(kv_shape), plan.valid


def attend_gathered(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, scale: float,
                    plan: PagePlan | None = None) -> tuple[Tensor, Tensor]:
    """q [B, Hq, D] over gathered keys/values [B, Hkv, S, D] at `valid` [B, Hkv, S] positions ->
    out [B, Hq, D] fp32 and lse [B, Hq] fp32 (-inf, with out 0, for a row with no valid position).
    `plan`: the gather's plan, whose mask is reused.

    The G query heads of a KV head are the query length of one CPU flash-attention call, which also
    returns the log-sum-exp (SDPA does not); its mask must be additive in the query's dtype."""
    b, hq, d = q.shape
    hkv = keys.shape[1]
    mask = additive_mask(valid, keys.dtype) if plan is None else plan.mask(keys.dtype)
    empty = ~valid.any(-1) if plan is None else plan.empty
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(keys.dtype).view(b, hkv, hq // hkv, d), keys, values, attn_mask=mask, scale=scale)
    lse = lse.masked_fill(empty[..., None], float("-inf"))  # [B, Hkv, G]
    return out.nan_to_num_(0.0).reshape(b, hq, d).float(), lse.reshape(b, hq)


def _attend_pages_reference(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                            seq_lens: Tensor, pages: Tensor, scale: float | None,
                            workspace: GatherWorkspace | None = None) -> Tensor:
    """Attention over the logical pages `pages` [B, Hkv, K] (-1 = none) -> [B, Hq, D] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if pages.shape[2] == 0:
        return torch.zeros_like(q)
    b, hq, d = q.shape
    hkv = k_pages.shape[1]
    keys, values, valid = gather_pages(q, k_pages, v_pages, block_table, seq_lens, pages, workspace)
    # The G query heads of a KV head are SDPA's query length: one fused pass over K and V.
    out = F.scaled_dot_product_attention(q.to(keys.dtype).view(b, hkv, hq // hkv, d), keys, values,
                                         attn_mask=valid[:, :, None, :], scale=scale)
    out = out.nan_to_num_(0.0)  # a request with no valid position (SDPA gives NaN) -> zeros
    return out.reshape(b, hq, d).to(q.dtype)


def sparse_decode_reference(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                            seq_lens: Tensor, selected: Tensor, scale: float | None = None,
                            workspace: GatherWorkspace | None = None) -> Tensor:
    """sparse_paged_attention in torch: q [B, Hq, D], selected [B, Hkv, K] logical pages -> [B, Hq, D]."""
    return _attend_pages_reference(q, k_pages, v_pages, block_table, seq_lens, selected, scale, workspace)


def _paged_decode_kernel(q, k_pages, v_pages, block_table, seq_lens, selected, groups, ws_m, ws_l, ws_acc,
                         scale_log2, n_slots, n_splits,
                         s_qb, s_qh, s_kp0, s_kp1, s_kp2, s_vp0, s_vp1, s_vp2, s_bt0, s_sel0, s_sel1,
                         s_mb, s_mh, s_ab, s_ah, s_as,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, QT: tl.constexpr):
    b = tl.program_id(0)  # a row, or with QT > 1 a group of up to QT consecutive rows of one sequence
    h = tl.program_id(1)
    sp = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    g = tl.arange(0, BLOCK_G)  # (query t of the group, query head gi of the KV head's group)
    t = g // G
    gi = g % G
    dm = d < D
    if QT == 1:
        r0 = b
        gm = g < G
    else:
        r0 = tl.load(groups + b)
        gm = (g < QT * G) & (t < tl.load(groups + b + 1) - r0)
    row = r0 + t
    qg = tl.load(q + row[:, None] * s_qb + (h * G + gi)[:, None] * s_qh + d[None, :],
                 mask=gm[:, None] & dm[None, :], other=0.0)
    if UPCAST:  # the interpreter's tl.dot mishandles bf16 (raw bits): same rounded values, fp32 dots
        qg = qg.to(tl.float32)
    lim = tl.load(seq_lens + row, mask=gm, other=0).to(tl.int32)  # each query's cache length
    seq_len = tl.max(lim, axis=0)
    # this row's extent: its pages (dense) or its selected list, which never holds more entries than the
    # row has pages; split into n_splits ranges of whole BLOCK_N blocks, so that every split of a short
    # row shares its work and no program scans slots past the row's end
    extent = tl.minimum(n_slots, (seq_len + PAGE - 1) // PAGE)
    per_block = BLOCK_N // PAGE
    per_split = ((extent + per_block - 1) // per_block + n_splits - 1) // n_splits * per_block
    start = sp * per_split
    end = tl.minimum(start + per_split, extent)
    tok = tl.arange(0, BLOCK_N)
    tok_off = tok % PAGE
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for ps in range(start, end, BLOCK_N // PAGE):
        slot = ps + tok // PAGE
        in_range = slot < end
        if DENSE:
            lp = tl.where(in_range, slot, -1)
        else:
            lp = tl.load(selected + r0 * s_sel0 + h * s_sel1 + slot, mask=in_range, other=-1)
        pos = lp * PAGE + tok_off
        valid = (lp >= 0) & (pos < seq_len)
        phys = tl.load(block_table + r0 * s_bt0 + lp, mask=valid, other=-1).to(tl.int64)
        valid = valid & (phys >= 0)
        kv_mask = valid[:, None] & dm[None, :]
        kt = tl.load(k_pages + phys[:, None] * s_kp0 + h * s_kp1 + tok_off[:, None] * s_kp2 + d[None, :],
                     mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(qg, tl.trans(kt), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] < lim[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_pages + phys[:, None] * s_vp0 + h * s_vp1 + tok_off[:, None] * s_vp2 + d[None, :],
                     mask=kv_mask, other=0.0)
        p_lo = p.to(vt.dtype)  # bf16 inputs: P @ V as a bf16 dot with fp32 accumulation
        if UPCAST:
            p_lo = p_lo.to(tl.float32)
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_lo, vt, input_precision=PRECISION)
        m_i = m_new
    hq = h * G + gi
    tl.store(ws_m + row * s_mb + hq * s_mh + sp, m_i, mask=gm)
    tl.store(ws_l + row * s_mb + hq * s_mh + sp, l_i, mask=gm)
    tl.store(ws_acc + row[:, None] * s_ab + hq[:, None] * s_ah + sp * s_as + d[None, :], acc,
             mask=gm[:, None] & dm[None, :])


def _merge_splits_kernel(ws_m, ws_l, ws_acc, out, n_splits, s_mb, s_mh, s_ab, s_ah, s_as, s_ob, s_oh,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < n_splits
    dm = d < D
    m = tl.load(ws_m + b * s_mb + h * s_mh + s, mask=sm, other=float("-inf"))
    l_s = tl.load(ws_l + b * s_mb + h * s_mh + s, mask=sm, other=0.0)
    acc = tl.load(ws_acc + b * s_ab + h * s_ah + s[:, None] * s_as + d[None, :],
                  mask=sm[:, None] & dm[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_s, axis=0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out + b * s_ob + h * s_oh + d, o.to(out.dtype.element_ty), mask=dm)


_paged_decode_jit = lazy_jit(_paged_decode_kernel)
_merge_splits_jit = lazy_jit(_merge_splits_kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(q: Tensor, b: int, hkv: int, n_blocks: int) -> int:
    """Enough splits for ~2 programs per SM, never more than one split per BLOCK_N block."""
    if q.is_cuda:
        target = 2 * _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    else:
        target = 4  # interpreter: a few splits so the merge is exercised, no more (it is slow)
    return max(1, min(n_blocks, -(-target // max(1, b * hkv))))


def paged_decode_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor,
                        selected: Tensor | None, scale: float | None = None, num_splits: int | None = None,
                        block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                        groups: Tensor | None = None, queries_per_group: int = 1) -> Tensor:
    """Shared launcher: selected=None -> dense over all pages, else sparse over `selected`. `groups`
    [B + 1] (dense only): rows groups[i]..groups[i+1]-1, at most `queries_per_group` of them, are queries
    of one sequence (one block table, the first row's): one program per group and KV head reads its
    pages once for all of them, each query masked at its own seq_len (trailing groups may be empty)."""
    require_triton()
    if groups is None:
        queries_per_group = 1
    assert queries_per_group == 1 or selected is None, "grouped queries attend densely"
    b, hq, d = q.shape
    _, hkv, page_size, dk = k_pages.shape
    assert dk == d and hq % hkv == 0, "q [B, Hq, D] and k_pages [N, Hkv, P, D] disagree"
    assert page_size >= 1 and page_size & (page_size - 1) == 0, "page size must be a power of two"
    assert k_pages.dtype == v_pages.dtype, "k_pages and v_pages must share a dtype"
    g = hq // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    out = torch.empty_like(q)
    dense = selected is None
    n_slots = block_table.shape[1] if dense else selected.shape[2]
    if b == 0:
        return out
    if n_slots == 0:
        return out.zero_()
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages and v_pages must be contiguous in the head dim")
    q_dot = q.to(k_pages.dtype)
    q_dot = q_dot if q_dot.stride(2) == 1 else q_dot.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    sel = block_table if dense else selected.contiguous()
    if block_n is None:
        block_n = max(page_size, 64 if d <= 64 else 32) if not q.is_cuda else max(page_size, 64)
    assert block_n % page_size == 0 and block_n & (block_n - 1) == 0 and block_n >= 16
    pages_per_block = block_n // page_size
    n_blocks = -(-n_slots // pages_per_block)
    splits = num_splits or _default_splits(q, b, hkv, n_blocks)
    splits = max(1, min(splits, n_blocks))
    ws_m = torch.empty(b, hq, splits, device=q.device, dtype=torch.float32)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(b, hq, splits, d, device=q.device, dtype=torch.float32)
    upcast = interpreting() and k_pages.dtype != torch.float32
    precision = "ieee"  # fp32 inputs: true fp32 dots (no tf32); ignored for bf16/fp16 operands
    _paged_decode_jit[(b, hkv, splits)](
        q_dot, k_pages, v_pages, block_table, seq_lens, sel, seq_lens if groups is None else groups,
        ws_m, ws_l, ws_acc,
        scale * LOG2E, n_slots, splits,
        q_dot.stride(0), q_dot.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table.stride(0), sel.stride(0), sel.stride(1) if not dense else 0,
        ws_m.stride(0), ws_m.stride(1), ws_acc.stride(0), ws_acc.stride(1), ws_acc.stride(2),
        D=d, BLOCK_D=max(16, next_pow2(d)), G=g, BLOCK_G=max(16, next_pow2(g * queries_per_group)),
        PAGE=page_size, BLOCK_N=block_n, DENSE=dense, PRECISION=precision, UPCAST=upcast,
        QT=queries_per_group, num_warps=num_warps, num_stages=num_stages,
    )
    _merge_splits_jit[(b, hq)](
        ws_m, ws_l, ws_acc, out, splits,
        ws_m.stride(0), ws_m.stride(1), ws_acc.stride(0), ws_acc.stride(1), ws_acc.stride(2),
        out.stride(0), out.stride(1),
        D=d, BLOCK_D=next_pow2(d), BLOCK_S=next_pow2(splits), num_warps=1 if d <= 64 else 2,
    )
    return out


def sparse_decode_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                         seq_lens: Tensor, selected: Tensor, scale: float | None = None,
                         num_splits: int | None = None, block_n: int | None = None,
                         num_warps: int = 4) -> Tensor:
    """sparse_paged_attention in Triton (flash-decoding over the selected pages)."""
    return paged_decode_triton(q, k_pages, v_pages, block_table, seq_lens, selected, scale,
                               num_splits=num_splits, block_n=block_n, num_warps=num_warps)


