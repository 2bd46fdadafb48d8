"""Teacher-forced block-sparse attention: many query positions of one sequence, each over its own kept
pages, in tiles that read every page once for all the queries of a tile.

out[c, hq] = softmax(scale * q[c, hq] . K^T) V over the tokens s of the sequence with
kept[c, hq // G, s // P] set and s <= positions[c]; a row that keeps no token gets zeros.
q [C, Hq, D] are C query positions of one sequence (any order, usually consecutive); keys, values
[Hkv, S, D] hold position s at index s; kept [C, Hkv, ceil(S / P)] uint8 is each query's page set
(`kept_page_bitmap` of the selection's page lists).

Why a kernel of its own: scoring a trajectory teacher-forced makes every position a query with its own
selection. As decode queries each re-reads its kept pages (a budget's worth of KV per position), so
the reads grow with positions x budget. Here a program owns a tile of consecutive positions of one KV
head (their G query heads as rows of one [BLOCK_R, D] operand), walks the tokens 0..its last position
in BLOCK_N blocks, loads a block's keys and values once when any row keeps a page of it (skipped
otherwise) and masks each row to its own pages and causal limit: tensor-core dots, an online softmax
in base 2, fp32 accumulation. Which blocks a tile keeps is reduced from the bitmap before the launch
(`tile_blocks`), so the skip is one scalar load per block, not a reduction across the program's warps.
bf16 inputs use bf16 dots (under the interpreter, whose tl.dot mishandles bf16, the same rounded
operands are upcast to fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton_utils import interpreting, lazy_jit, next_pow2, require_triton

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)

LOG2E = 1.4426950408889634

BLOCK_ROWS = 128  # query rows (positions x query heads of one KV head) per program on a GPU
BLOCK_TOKENS = 64  # keys per iteration
WARPS = 8
STAGES = 2


def kept_page_bitmap(selected: Tensor, n_pages: int) -> Tensor:
    """selected [C, Hkv, K] logical pages (-1 = none) -> kept [C, Hkv, n_pages] uint8 (1 = kept)."""
    c, hkv, _ = selected.shape
    kept = torch.zeros(c, hkv, n_pages + 1, dtype=torch.uint8, device=selected.device)
    index = torch.where(selected < 0, n_pages, selected).long()
    return kept.scatter_(2, index, 1)[..., :n_pages]


def tile_blocks(kept: Tensor, tile: int, pages_per_block: int) -> Tensor:
    """kept [C, Hkv, n_pages] -> [ceil(C / tile), Hkv, ceil(n_pages / pages_per_block)] uint8: whether any
    query of a tile of `tile` consecutive rows keeps a page of a block of `pages_per_block` pages."""
    c, hkv, n = kept.shape
    tiles, blocks = -(-c // tile), -(-n // pages_per_block)
    padded = torch.nn.functional.pad(kept, (0, blocks * pages_per_block - n, 0, 0, 0, tiles * tile - c))
    return padded.view(tiles, tile, hkv, blocks, pages_per_block).amax(dim=(1, 4))


def token_mask(kept: Tensor, positions: Tensor, s: int, page_size: int) -> Tensor:
    """kept [C, Hkv, n_pages], positions [C] -> [C, Hkv, S] bool: the keys each query attends to."""
    by_token = kept.bool().repeat_interleave(page_size, dim=2)[..., :s]
    return by_token & (torch.arange(s, device=kept.device) <= positions[:, None, None])


def sparse_prefill_reference(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, kept: Tensor,
                             page_size: int = 16, scale: float | None = None) -> Tensor:
    """The kernel's definition in fp32 torch -> [C, Hq, D] in q's dtype."""
    c, hq, d = q.shape
    hkv, s, _ = keys.shape
    scale = d ** -0.5 if scale is None else scale
    mask = token_mask(kept, positions, s, page_size).repeat_interleave(hq // hkv, dim=1)  # [C, Hq, S]
    k = keys.float().repeat_interleave(hq // hkv, dim=0)  # [Hq, S, D]
    v = values.float().repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("chd,hsd->chs", q.float(), k) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("chs,hsd->chd", weights, v).to(q.dtype)


def _sparse_prefill_kernel(q, keys, values, positions, kept, blocks, out, n_rows, n_keys, scale_log2,
                           s_qc, s_qh, s_kh, s_ks, s_vh, s_vs, s_mc, s_mh, s_bt, s_bh, s_oc, s_oh,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, TILE: tl.constexpr,
                           BLOCK_R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)  # row r: position t = r // G of the tile, query head gi = r % G
    t = r // G
    gi = r % G
    row = tl.program_id(0) * TILE + t
    tile_blocks = blocks + tl.program_id(0) * s_bt + h * s_bh  # [n_blocks] uint8: the tile keeps block i
    rm = (t < TILE) & (row < n_rows)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qt = tl.load(q + row[:, None] * s_qc + (h * G + gi)[:, None] * s_qh + d[None, :],
                 mask=rm[:, None] & dm[None, :], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    pos = tl.load(positions + row, mask=rm, other=-1).to(tl.int32)
    end = tl.minimum(tl.max(pos, axis=0) + 1, n_keys)  # keys past the tile's last query are never seen
    tok = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(0, end, BLOCK_N):
        s_idx = start + tok
        in_seq = s_idx < end
        pg = start // PAGE + tl.arange(0, BLOCK_N // PAGE)
        keep = tl.load(kept + row[:, None] * s_mc + h * s_mh + pg[None, :],
                       mask=rm[:, None] & (pg * PAGE < end)[None, :], other=0)  # [BLOCK_R, pages]
        keep = tl.reshape(tl.broadcast_to(keep[:, :, None], [BLOCK_R, BLOCK_N // PAGE, PAGE]),
                          [BLOCK_R, BLOCK_N])
        keep = (keep != 0) & (s_idx[None, :] <= pos[:, None])  # [BLOCK_R, BLOCK_N]
        if tl.load(tile_blocks + start // BLOCK_N) != 0:  # some row keeps a page of the block
            kv_mask = in_seq[:, None] & dm[None, :]
            kt = tl.load(keys + h * s_kh + s_idx[:, None] * s_ks + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * scale_log2
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(values + h * s_vh + s_idx[:, None] * s_vs + d[None, :], mask=kv_mask, other=0.0)
            p_lo = p.to(vt.dtype)
            if UPCAST:
                p_lo = p_lo.to(tl.float32)
                vt = vt.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_lo, vt, input_precision=PRECISION)
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + row[:, None] * s_oc + (h * G + gi)[:, None] * s_oh + d[None, :],
             o.to(out.dtype.element_ty), mask=rm[:, None] & dm[None, :])


_sparse_prefill_jit = lazy_jit(_sparse_prefill_kernel)


def sparse_prefill_triton(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, kept: Tensor,
                          page_size: int = 16, scale: float | None = None, block_rows: int | None = None,
                          block_tokens: int | None = None, num_warps: int | None = None,
                          num_stages: int = STAGES) -> Tensor:
    """`sparse_prefill_reference` in Triton -> [C, Hq, D] in q's dtype. `block_rows`: query rows per
    program (a power of two >= 16; a tile holds block_rows // G positions); `block_tokens`: keys per
    iteration (a multiple of the page size). Unset, the module's BLOCK_ROWS, BLOCK_TOKENS and WARPS (the
    interpreter: 16 rows)."""
    require_triton()
    c, hq, d = q.shape
    hkv, s, dk = keys.shape
    assert dk == d and hq % hkv == 0, "q [C, Hq, D] and keys [Hkv, S, D] disagree"
    assert kept.shape == (c, hkv, -(-s // page_size)), "kept must be [C, Hkv, ceil(S / page_size)]"
    assert keys.dtype == values.dtype, "keys and values must share a dtype"
    g = hq // hkv
    out = torch.empty_like(q)
    if c == 0:
        return out
    if block_rows is None:
        block_rows = BLOCK_ROWS if q.is_cuda else 16  # the interpreter: small tiles, many of them
    block_rows = max(block_rows, 16, next_pow2(g))
    block_tokens = block_tokens or BLOCK_TOKENS
    assert block_tokens % page_size == 0 and block_tokens >= 16, "block_tokens: a multiple of the page size"
    tile = block_rows // g
    q_dot = q.to(keys.dtype)
    q_dot = q_dot if q_dot.stride(2) == 1 else q_dot.contiguous()
    if keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("keys and values must be contiguous in the head dim")
    positions = positions.to(torch.int32).contiguous()
    kept = kept if kept.stride(2) == 1 else kept.contiguous()  # the bitmap's slice of its scatter target
    blocks = tile_blocks(kept, tile, block_tokens // page_size)
    upcast = interpreting() and keys.dtype != torch.float32
    _sparse_prefill_jit[(-(-c // tile), hkv)](
        q_dot, keys, values, positions, kept, blocks, out, c, s,
        (d ** -0.5 if scale is None else scale) * LOG2E,
        q_dot.stride(0), q_dot.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        kept.stride(0), kept.stride(1), blocks.stride(0), blocks.stride(1), out.stride(0), out.stride(1),
        D=d, BLOCK_D=max(16, next_pow2(d)), G=g, TILE=tile, BLOCK_R=block_rows, PAGE=page_size,
        BLOCK_N=block_tokens, PRECISION="ieee", UPCAST=upcast, num_warps=num_warps or WARPS,
        num_stages=num_stages,
    )
    return out
