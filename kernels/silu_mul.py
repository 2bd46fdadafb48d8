"""silu_mul: the MLP's activation over the stacked gate/up product, SiLU(gate) x up, in one pass.

gate_up [N, 2I] holds each row's gate (first I columns) and up (last I) as one product over the stacked
gate/up weights gives them; out [N, I] = silu(gate) * up with the eager `F.silu(gate) * up`'s rounding
points (stages/model/llama.py MLP): silu computed in fp32 and rounded to the dtype, then the product
rounded. The Triton kernel: grid (rows, column blocks), each element read and written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton_utils import lazy_jit, next_pow2, require_triton, round_to

tl = None  # triton.language, bound on the first kernel launch (see _triton_utils)


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_mul_kernel(gate_up, out, s_in, s_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_cols
    dt = out.dtype.element_ty
    g = tl.load(gate_up + row * s_in + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * s_in + n_cols + c, mask=m, other=0.0).to(tl.float32)
    s = round_to(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out + row * s_out + c, round_to(s * u, dt).to(dt), mask=m)


_silu_mul_jit = lazy_jit(_silu_mul_kernel, helpers=(round_to,))


def silu_mul_triton(gate_up: Tensor, out: Tensor | None = None, block: int = 1024) -> Tensor:
    require_triton()
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1, "gate_up must be [N, 2I] with contiguous rows"
    i = two_i // 2
    out = torch.empty(n, i, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if n == 0 or i == 0:
        return out
    block = min(block, next_pow2(i))
    _silu_mul_jit[(n, -(-i // block))](gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=block,
                                      num_warps=4 if block >= 512 else 1)
    return out
