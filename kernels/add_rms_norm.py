"""add_rms_norm: a decoder layer's residual add and the RMSNorm after it, in one pass over each row.

For rows of x and residual [N, H] (model dtype): residual <- residual + x, rounded to the dtype as the
eager `x = x + f(x)` rounds it (in place), then out = weight * (r * rsqrt(mean(r^2) + eps)) computed on
the rounded residual with the eager `RMSNorm` module's rounding points (stages/model/llama.py): the
statistics in fp32, the normalised row rounded to the dtype before the weight multiplies it, the product
rounded once. With x None there is no add (a decode step's first input norm), and nothing is written
to the residual. In fp32 every rounding is a no-op and kernel and reference differ by the order of one
sum; in bf16 they differ only where that sum's order moves a rounding.

The Triton kernel runs one program per row with the whole row in one block (H is a few thousand in
every model we run), so each row is read once and the residual and the normed row written once: in a
decode step these are the bytes the step must move, where the eager chain ran six kernels per norm.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton_utils import lazy_jit, next_pow2, require_triton, round_to

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The eager RMSNorm module over the last dim: fp32 (at least) statistics, rounded, then weighted."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_reference(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """residual [N, H] += x (in place, unless x is None) -> RMSNorm(residual) [N, H]."""
    if x is not None:
        residual.copy_(residual + x)
    return rms_norm_reference(residual, weight, eps)


def _add_rms_norm_kernel(x, residual, weight, out, s_x, s_r, s_o, n_cols, eps,
                         BLOCK: tl.constexpr, HAS_X: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    dt = residual.dtype.element_ty
    r = tl.load(residual + row * s_r + c, mask=m, other=0.0).to(tl.float32)
    if HAS_X:
        r = round_to(r + tl.load(x + row * s_x + c, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(residual + row * s_r + c, r.to(dt), mask=m)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / n_cols + eps)
    normed = round_to(r * rstd, dt)  # the module rounds before the weight multiplies
    w = tl.load(weight + c, mask=m, other=0.0).to(tl.float32)
    od = out.dtype.element_ty
    tl.store(out + row * s_o + c, round_to(normed * w, od).to(od), mask=m)


_add_rms_norm_jit = lazy_jit(_add_rms_norm_kernel, helpers=(round_to,))


def add_rms_norm_triton(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float,
                        out: Tensor | None = None) -> Tensor:
    """add_rms_norm in one Triton kernel; `out` [N, H]: where the normed rows go (a new tensor if None)."""
    require_triton()
    n, h = residual.shape
    assert residual.stride(1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    if x is not None:
        assert x.shape == residual.shape and x.stride(1) == 1, "x must be [N, H] with contiguous rows"
    out = torch.empty_like(residual) if out is None else out
    if n == 0:
        return out
    block = next_pow2(h)
    _add_rms_norm_jit[(n,)](
        residual if x is None else x, residual, weight, out,
        0 if x is None else x.stride(0), residual.stride(0), out.stride(0), h, float(eps),
        BLOCK=block, HAS_X=x is not None, num_warps=min(16, max(1, block // 256)),
    )
    return out
