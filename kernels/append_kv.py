"""append_kv: write one new token's K/V per request into the paged cache and update page centroids.

Computes, for each row n of `k`/`v` [N, Hkv, D] with physical slot s = page * P + offset,
k_pages[page, :, offset] = k[n], v_pages[page, :, offset] = v[n] and the running mean key of the page
c <- c + (k - c) / (offset + 1) (offset 0 sets c = k), in place; rows with a negative slot are skipped
(padding). The Triton kernel runs one program per (row, KV head): it loads one D-vector of K and of V,
stores them at the slot, and updates that head's centroid in fp32 (rounded once to the centroids' dtype,
fp32 or bf16), so rows must target distinct pages
(true in decode: one new token per request, shared pages are copied before they are appended to).
`write_prefill` (torch only) scatters many tokens at once and recomputes the touched pages' centroids
as the mean of their keys over offsets 0..max written offset.

Centroids narrower than fp32 (bf16, half the bytes selection reads): a running mean rounded to bf16 at
each of a page's 16 appends drifts from the page's mean by several roundings, enough to change kept page
sets noticeably against fp32 centroids (bench/centroid_dtype.py, docs/gpu.md). So the append that completes
a page (offset P - 1) sets its centroid to the mean of its P keys, computed in
fp32 and rounded once, as write_prefill sets a prefilled page's; partial pages keep the running mean,
which no selection reads (only complete pages are candidates). fp32 centroids are the running mean
throughout, bit for bit as before (and as the C++ kernels compute them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton_utils import lazy_jit, next_pow2, require_triton, round_to

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)


def _drop_padding(slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows with a negative slot are padding and write nothing."""
    keep = slots >= 0
    return (slots, k, v) if bool(keep.all()) else (slots[keep], k[keep], v[keep])


def append_kv_reference(k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor,
                        slots: Tensor) -> None:
    page_size = k_pages.shape[2]
    slots, k, v = _drop_padding(slots.long(), k, v)
    page, off = slots // page_size, slots % page_size
    k_new = k.to(k_pages.dtype)
    k_pages[page, :, off] = k_new
    v_pages[page, :, off] = v.to(v_pages.dtype)
    acc = torch.promote_types(centroids.dtype, torch.float32)  # bf16 centroids: fp32 math, one rounding
    c = centroids[page].to(acc)  # [N, Hkv, D]
    kf = k_new.to(acc)
    # offset 0 sets c = k exactly: c + (k - c) would round through whatever a reused page held, and a
    # recomputed sequence (preemption) must get bit-identical centroids from the same keys
    running = c + (kf - c) / (off + 1).to(acc)[:, None, None]
    new = torch.where((off == 0)[:, None, None], kf, running)
    if centroids.dtype != acc:  # narrow centroids: a page's last key sets its mean, rounded once
        full = k_pages[page].to(acc).sum(2) / page_size  # [N, Hkv, D], the page as now written
        new = torch.where((off == page_size - 1)[:, None, None], full, new)
    centroids[page] = new.to(centroids.dtype)


def write_prefill(k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor,
                  slots: Tensor) -> None:
    """Scatter many tokens (any number per page), then recompute the touched pages' centroids."""
    page_size = k_pages.shape[2]
    slots, k, v = _drop_padding(slots.long(), k, v)
    if slots.numel() == 0:
        return
    page, off = slots // page_size, slots % page_size
    k_pages[page, :, off] = k.to(k_pages.dtype)
    v_pages[page, :, off] = v.to(v_pages.dtype)
    touched, inverse = torch.unique(page, return_inverse=True)
    max_off = torch.full((touched.numel(),), -1, dtype=torch.long, device=slots.device)
    max_off.scatter_reduce_(0, inverse, off, reduce="amax")
    set_page_means(k_pages, centroids, touched, max_off + 1)


def set_page_means(k_pages: Tensor, centroids: Tensor, pages: Tensor, filled: Tensor) -> None:
    """centroids[pages[i]] = the mean of page pages[i]'s first filled[i] keys, in fp32 (at least) and
    rounded once (slots past them may hold garbage). k_pages [..., N, Hkv, P, D] and centroids
    [..., N, Hkv, D]: one layer's, or every layer's at once."""
    acc = torch.promote_types(centroids.dtype, torch.float32)
    keys = k_pages[..., pages, :, :, :].to(acc)  # [..., T, Hkv, P, D]
    valid = torch.arange(k_pages.shape[-2], device=pages.device) < filled[:, None]  # [T, P]
    sums = torch.where(valid[:, None, :, None], keys, 0.0).sum(-2)
    centroids[..., pages, :, :] = (sums / filled.to(acc)[:, None, None]).to(centroids.dtype)


def _append_kv_kernel(k_pages, v_pages, centroids, k, v, slots,
                      s_kp0, s_kp1, s_kp2, s_vp0, s_vp1, s_vp2, s_c0, s_c1,
                      s_k0, s_k1, s_v0, s_v1,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, MEAN_AT_END: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + n)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        kk = tl.load(k + n * s_k0 + h * s_k1 + d, mask=dm, other=0.0)
        vv = tl.load(v + n * s_v0 + h * s_v1 + d, mask=dm, other=0.0)
        kq = kk.to(k_pages.dtype.element_ty)
        tl.store(k_pages + page * s_kp0 + h * s_kp1 + off * s_kp2 + d, kq, mask=dm)
        tl.store(v_pages + page * s_vp0 + h * s_vp1 + off * s_vp2 + d,
                 vv.to(v_pages.dtype.element_ty), mask=dm)
        cptr = centroids + page * s_c0 + h * s_c1 + d
        c = tl.load(cptr, mask=dm, other=0.0).to(tl.float32)
        kf = kq.to(tl.float32)
        c = tl.where(off == 0, kf, c + (kf - c) / (off + 1).to(tl.float32))  # offset 0: exactly k
        if MEAN_AT_END:  # narrow centroids: the page's last key sets the mean of its keys (read then only)
            o = tl.arange(0, PAGE)
            earlier = tl.load(k_pages + page * s_kp0 + h * s_kp1 + o[:, None] * s_kp2 + d[None, :],
                              mask=((o < PAGE - 1) & (o * 0 + off == PAGE - 1))[:, None] & dm[None, :],
                              other=0.0)
            c = tl.where(off == PAGE - 1, (tl.sum(earlier.to(tl.float32), axis=0) + kf) / PAGE, c)
        tl.store(cptr, round_to(c, centroids.dtype.element_ty).to(centroids.dtype.element_ty), mask=dm)


_append_kv_jit = lazy_jit(_append_kv_kernel, helpers=(round_to,))


def append_kv_triton(k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor,
                     slots: Tensor, num_warps: int = 1) -> None:
    require_triton()
    n, hkv, d = k.shape
    if n == 0:
        return
    page_size = k_pages.shape[2]
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1 or centroids.stride(2) != 1:
        raise ValueError("k_pages, v_pages and centroids must be contiguous in the head dim")
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    slots = slots.to(torch.int64).contiguous()
    _append_kv_jit[(n, hkv)](
        k_pages, v_pages, centroids, k, v, slots,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        centroids.stride(0), centroids.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        D=d, BLOCK_D=next_pow2(d), PAGE=page_size, MEAN_AT_END=centroids.dtype != torch.float32,
        num_warps=num_warps,
    )
