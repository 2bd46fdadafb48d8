"""bf16 linears through fp32 products, on a CPU whose oneDNN has no bf16 products.

Without AVX512 or AVX-NE-CONVERT, torch computes a bf16 product with its generic kernels, several times
slower than its fp32 product once a call has a few dozen rows. A bf16 product accumulates in fp32 and
rounds the result to bf16 once; so does an fp32 product of the bf16 values rounded to bf16, up to the
order of the sums. Within `fp32_products(model)`, the model's linears compute that way for calls of at
least MIN_ROWS rows (a prefill, teacher-forced scoring), when no gradient is recorded (fp32 copies of the
weights would be kept for the backward pass). Fewer rows (a decode step) keep the bf16 product, which
reads half the bytes of weight and costs less than the weight's conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear_forwards import linear_forwards

MIN_ROWS = 16


def onednn_runs_bf16() -> bool:
    """Whether this CPU's oneDNN has bf16 products (AVX512 or AVX-NE-CONVERT); without them torch computes
    bf16 with generic kernels, slower than its fp32 products."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_products_are_slow(model: nn.Module) -> bool:
    """bf16 weights on a CPU whose oneDNN has no bf16 products."""
    w = next(model.parameters())
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and not onednn_runs_bf16()


def fp32_products(model: nn.Module) -> AbstractContextManager[None]:
    """Within: the model's nn.Linear products of MIN_ROWS rows or more computed in fp32 and rounded to bf16,
    where `bf16_products_are_slow`; elsewhere nothing changes."""
    return linear_forwards(model, _in_fp32) if bf16_products_are_slow(model) else nullcontext()


def _in_fp32(linear: nn.Linear) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        w, b = linear.weight, linear.bias
        if x.numel() < MIN_ROWS * x.shape[-1] or torch.is_grad_enabled() or w.dtype != torch.bfloat16:
            return F.linear(x, w, b)
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return forward
