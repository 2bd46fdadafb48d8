"""A candidate for the decode step's page selection, timed beside the radix select by
`bench/kernel_times.py --part select-sweep` (which checks that it keeps the same pages).

The radix select (kernels/page_scoring.py) makes five dependent passes over a row's scores, four of
them a 256-bin histogram. Here one program holds its whole row in registers and finds the n-th largest
key by counting: each pass compares every key with the 2^DIGIT_BITS thresholds that extend the digits
found so far by one more digit, sums the counts over the row, and keeps the largest digit whose count
still reaches n (32 / DIGIT_BITS passes, no histogram, no scan until the last pass). The last pass keeps
the keys above the threshold and, of those equal to it, the lowest pages, adds the reserved pages and
writes the kept pages in index order, as the radix select does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparrow.kernels._triton_utils import lazy_jit, next_pow2, require_triton
from sparrow.stages.core.definitions import RESERVED_PAGES

tl = None  # triton.language, bound on the first kernel launch (see sparrow.kernels._triton_utils)


def _select_count_kernel(scores, seq_lens, budgets, selected, s_sb, s_sh, s_ob, s_oh, max_pages, width,
                         PAGE: tl.constexpr, RESERVED: tl.constexpr, BLOCK: tl.constexpr,
                         DIGIT_BITS: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    budget = tl.load(budgets + b).to(tl.int32)
    n_pages = (seq_len + PAGE - 1) // PAGE
    last = n_pages - 1
    n_read = tl.minimum(n_pages, max_pages)
    cand_end = tl.minimum(tl.maximum(last - 1, 0), max_pages)  # candidates: pages 1..last-2
    n_sel = tl.maximum(tl.where(budget > 0, budget // PAGE - RESERVED, max_pages), 0)
    p = tl.arange(0, BLOCK)
    s = tl.load(scores + b * s_sb + h * s_sh + p, mask=(p >= 1) & (p < cand_end), other=float("-inf"))
    cand = s > float("-inf")
    bits = s.to(tl.int32, bitcast=True)
    key = (tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) ^ (-2147483648)).to(tl.uint32, bitcast=True)
    search = tl.sum(cand.to(tl.int32), axis=0) > n_sel
    digit_values = tl.arange(0, 1 << DIGIT_BITS).to(tl.uint32)
    prefix = tl.zeros([], dtype=tl.uint32)
    for i in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (i + 1)
        thresholds = prefix + (digit_values << shift)  # [2^DIGIT_BITS]
        counts = tl.sum(((key[:, None] >= thresholds[None, :]) & cand[:, None]).to(tl.int32), axis=0)
        digit = tl.sum((counts >= n_sel).to(tl.int32), axis=0) - 1  # counts fall as the digit grows
        prefix = prefix + (digit.to(tl.uint32) << shift)
    above = cand & (key > prefix)
    tie = cand & (key == prefix)
    need = n_sel - tl.sum(above.to(tl.int32), axis=0)
    chosen = tl.where(search, above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need)), cand)
    reserved = ((p == 0) | ((p >= last - 1) & (p <= last))) & (p < n_read)
    kept = (chosen | reserved).to(tl.int32)
    pos = tl.cumsum(kept, axis=0) - 1
    out = selected + b * s_ob + h * s_oh
    tl.store(out + pos, p, mask=(kept > 0) & (pos < width))
    count = tl.sum(kept, axis=0)
    for start in range((tl.minimum(count, width) // BLOCK_W) * BLOCK_W, width, BLOCK_W):
        w = start + tl.arange(0, BLOCK_W)
        tl.store(out + w, tl.full([BLOCK_W], -1, tl.int32), mask=(w >= count) & (w < width))


_select_count_jit = lazy_jit(_select_count_kernel)


def select_count_triton(scores: Tensor, seq_lens: Tensor, budgets: Tensor, page_size: int, max_selected: int,
                        digit_bits: int = 4, num_warps: int = 8) -> Tensor:
    """`finish_selection` by counting: scores [B, Hkv, max_pages] -> selected [B, Hkv, max_selected]."""
    require_triton()
    assert 32 % digit_bits == 0, "digit_bits must divide 32"
    b, hkv, max_pages = scores.shape
    selected = torch.empty(b, hkv, max_selected, device=scores.device, dtype=torch.int32)
    if b == 0 or max_selected == 0 or max_pages == 0:
        return selected.fill_(-1)
    assert scores.stride(2) == 1, "scores must be contiguous along the pages"
    _select_count_jit[(b, hkv)](
        scores, seq_lens.contiguous(), budgets.contiguous(), selected,
        scores.stride(0), scores.stride(1), selected.stride(0), selected.stride(1), max_pages, max_selected,
        PAGE=page_size, RESERVED=RESERVED_PAGES, BLOCK=next_pow2(max_pages), DIGIT_BITS=digit_bits,
        BLOCK_W=min(1024, next_pow2(max_selected)), num_warps=num_warps,
    )
    return selected
