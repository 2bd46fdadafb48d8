"""qk_norm_rope_append: from a decode step's stacked q/k/v product to the attention's inputs, in one pass.

For each row n of qkv [N, (Hq + 2 Hkv) D] (one new token per request, at `positions[n]`, going to the
physical slot `slots[n]` = page * P + offset; < 0: a padding row that writes nothing):
- q, k = the row's Hq query and Hkv key heads, each RMS-normalised over D with `q_weight`/`k_weight`
  (Qwen3's per-head norm; skipped when the weights are None), then rotated by the rotary tables
  cos/sin [S, D] at the row's position (Hugging Face's half rotation: x cos + [-x2, x1] sin);
- k and v (the row's last Hkv heads) are written into k_pages/v_pages at the slot and the page's
  centroid is updated as `append_kv` updates it (c <- c + (k - c) / (offset + 1), offset 0 sets c = k,
  in fp32 from the key as stored, rounded once to the centroids' dtype; narrow centroids get the mean of
  the page's keys when its last key arrives);
- returns the rotated queries [N, Hq, D] for the attention that follows.
The arithmetic keeps the eager modules' rounding points (stages/model/llama.py): the norm as
`add_rms_norm`'s, cos and sin rounded to the model dtype as the model's forward rounds its tables, each
product of the rotation rounded and then their sum. So in fp32 the kernel is the eager chain up to the
order of one sum (and fused multiply-adds), in bf16 the same roundings.

The Triton kernel runs one program per (row, KV head): it loads the group's G query heads as one
[G, D/2] x 2 tile and the KV head's key and value, so each element of the row's product is read once,
and the cache and centroid are written where `append_kv` would write them. Where a decode layer ran
about twenty eager kernels between its q/k/v product and its attention, it now runs this one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton_utils import lazy_jit, next_pow2, require_triton, round_to
from .add_rms_norm import rms_norm_reference
from .append_kv import append_kv_reference

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] rotated by cos/sin broadcast to it (the model's `apply_rope`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def qk_norm_rope_append_reference(qkv: Tensor, positions: Tensor, slots: Tensor, cos: Tensor, sin: Tensor,
                                  q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                                  k_pages: Tensor, v_pages: Tensor, centroids: Tensor,
                                  num_heads: int) -> Tensor:
    """The eager chain: split, per-head norms, rotation, `append_kv_reference` -> q [N, Hq, D]."""
    n, hkv, d = qkv.shape[0], k_pages.shape[1], k_pages.shape[3]
    q, k, v = qkv.split([num_heads * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(n, num_heads, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
    if q_weight is not None:
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    c = cos[positions.long()].to(qkv.dtype)[:, None, :]
    s = sin[positions.long()].to(qkv.dtype)[:, None, :]
    q, k = rope_reference(q, c, s), rope_reference(k, c, s)
    append_kv_reference(k_pages, v_pages, centroids, k, v, slots)
    return q


def _qk_norm_rope_append_kernel(qkv, positions, slots, cos, sin, q_weight, k_weight, q_out,
                                k_pages, v_pages, centroids,
                                s_row, s_qo0, s_qo1, s_cs, s_kp0, s_kp1, s_kp2, s_vp0, s_vp1, s_vp2,
                                s_c0, s_c1, eps,
                                D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                                G: tl.constexpr, BLOCK_G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                                PAGE: tl.constexpr, QK_NORM: tl.constexpr, MEAN_AT_END: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dt = q_out.dtype.element_ty
    j = tl.arange(0, BLOCK_H)
    jm = j < HALF
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    pos = tl.load(positions + n).to(tl.int64)
    # the model rounds its rotary tables (fp32, or its dtype) to its dtype before it multiplies
    c1 = round_to(tl.load(cos + pos * s_cs + j, mask=jm, other=0.0).to(tl.float32), dt)
    c2 = round_to(tl.load(cos + pos * s_cs + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)
    s1 = round_to(tl.load(sin + pos * s_cs + j, mask=jm, other=0.0).to(tl.float32), dt)
    s2 = round_to(tl.load(sin + pos * s_cs + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)
    row = qkv + n * s_row

    # the group's query heads, [BLOCK_G, BLOCK_H] per half
    head = h * G + g
    qm = gm[:, None] & jm[None, :]
    q1 = tl.load(row + head[:, None] * D + j[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(row + head[:, None] * D + HALF + j[None, :], mask=qm, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / D + eps)
        w1 = tl.load(q_weight + j, mask=jm, other=0.0).to(tl.float32)
        w2 = tl.load(q_weight + HALF + j, mask=jm, other=0.0).to(tl.float32)
        q1 = round_to(round_to(q1 * rstd[:, None], dt) * w1[None, :], dt)
        q2 = round_to(round_to(q2 * rstd[:, None], dt) * w2[None, :], dt)
    o1 = round_to(round_to(q1 * c1[None, :], dt) - round_to(q2 * s1[None, :], dt), dt)
    o2 = round_to(round_to(q2 * c2[None, :], dt) + round_to(q1 * s2[None, :], dt), dt)
    q_row = q_out + n * s_qo0 + head[:, None] * s_qo1
    tl.store(q_row + j[None, :], o1.to(dt), mask=qm)
    tl.store(q_row + HALF + j[None, :], o2.to(dt), mask=qm)

    slot = tl.load(slots + n)
    if slot >= 0:
        k_row = row + (HQ + h) * D
        k1 = tl.load(k_row + j, mask=jm, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF + j, mask=jm, other=0.0).to(tl.float32)
        if QK_NORM:
            rstd_k = 1.0 / tl.sqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / D + eps)
            u1 = tl.load(k_weight + j, mask=jm, other=0.0).to(tl.float32)
            u2 = tl.load(k_weight + HALF + j, mask=jm, other=0.0).to(tl.float32)
            k1 = round_to(round_to(k1 * rstd_k, dt) * u1, dt)
            k2 = round_to(round_to(k2 * rstd_k, dt) * u2, dt)
        kd = k_pages.dtype.element_ty
        r1 = round_to(round_to(round_to(k1 * c1, dt) - round_to(k2 * s1, dt), dt), kd)  # the key as stored
        r2 = round_to(round_to(round_to(k2 * c2, dt) + round_to(k1 * s2, dt), dt), kd)
        page = slot // PAGE
        off = slot % PAGE
        kp = k_pages + page * s_kp0 + h * s_kp1 + off * s_kp2
        tl.store(kp + j, r1.to(kd), mask=jm)
        tl.store(kp + HALF + j, r2.to(kd), mask=jm)
        v_row = row + (HQ + HKV + h) * D
        vp = v_pages + page * s_vp0 + h * s_vp1 + off * s_vp2
        vd = v_pages.dtype.element_ty
        tl.store(vp + j, tl.load(v_row + j, mask=jm, other=0.0).to(vd), mask=jm)
        tl.store(vp + HALF + j, tl.load(v_row + HALF + j, mask=jm, other=0.0).to(vd), mask=jm)
        cp = centroids + page * s_c0 + h * s_c1
        cd = centroids.dtype.element_ty
        count = (off + 1).to(tl.float32)
        e1 = tl.load(cp + j, mask=jm, other=0.0).to(tl.float32)
        e2 = tl.load(cp + HALF + j, mask=jm, other=0.0).to(tl.float32)
        e1 = tl.where(off == 0, r1, e1 + (r1 - e1) / count)  # offset 0: exactly k
        e2 = tl.where(off == 0, r2, e2 + (r2 - e2) / count)
        if MEAN_AT_END:  # narrow centroids: the page's last key sets the mean of its keys (append_kv)
            o = tl.arange(0, PAGE)
            first = k_pages + page * s_kp0 + h * s_kp1 + o[:, None] * s_kp2
            done = ((o < PAGE - 1) & (o * 0 + off == PAGE - 1))[:, None] & jm[None, :]
            a1 = tl.load(first + j[None, :], mask=done, other=0.0).to(tl.float32)
            a2 = tl.load(first + HALF + j[None, :], mask=done, other=0.0).to(tl.float32)
            e1 = tl.where(off == PAGE - 1, (tl.sum(a1, axis=0) + r1) / PAGE, e1)
            e2 = tl.where(off == PAGE - 1, (tl.sum(a2, axis=0) + r2) / PAGE, e2)
        tl.store(cp + j, round_to(e1, cd).to(cd), mask=jm)
        tl.store(cp + HALF + j, round_to(e2, cd).to(cd), mask=jm)


_qk_norm_rope_append_jit = lazy_jit(_qk_norm_rope_append_kernel, helpers=(round_to,))


def qk_norm_rope_append_triton(qkv: Tensor, positions: Tensor, slots: Tensor, cos: Tensor, sin: Tensor,
                               q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                               k_pages: Tensor, v_pages: Tensor, centroids: Tensor, num_heads: int,
                               q_out: Tensor | None = None) -> Tensor:
    require_triton()
    n = qkv.shape[0]
    _, hkv, page_size, d = k_pages.shape
    assert d % 2 == 0 and num_heads % hkv == 0, "head dim must be even and Hq a multiple of Hkv"
    assert qkv.shape[1] == (num_heads + 2 * hkv) * d and qkv.stride(1) == 1, "qkv must be [N, (Hq+2Hkv)*D]"
    assert cos.stride(1) == 1 and cos.stride() == sin.stride(), "rotary tables must be [S, D] alike"
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1 or centroids.stride(2) != 1:
        raise ValueError("k_pages, v_pages and centroids must be contiguous in the head dim")
    assert (q_weight is None) == (k_weight is None), "q and k norms come together"
    q_out = torch.empty(n, num_heads, d, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    assert q_out.stride(2) == 1
    if n == 0:
        return q_out
    g = num_heads // hkv
    norm = q_weight is not None
    _qk_norm_rope_append_jit[(n, hkv)](
        qkv, positions.contiguous(), slots.to(torch.int64).contiguous(), cos, sin, q_weight if norm else cos,
        k_weight if norm else cos,
        q_out, k_pages, v_pages, centroids,
        qkv.stride(0), q_out.stride(0), q_out.stride(1), cos.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        centroids.stride(0), centroids.stride(1), float(eps),
        D=d, HALF=d // 2, BLOCK_H=next_pow2(d // 2), G=g, BLOCK_G=next_pow2(g), HQ=num_heads, HKV=hkv,
        PAGE=page_size, QK_NORM=norm, MEAN_AT_END=centroids.dtype != torch.float32,
        num_warps=1 if g * d <= 1024 else 2,
    )
    return q_out
