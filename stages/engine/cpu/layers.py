"""The CPU decode step's small per-layer ops in C++: RMSNorm and the rotary embedding of q and k.

Inside `active()` the model's RMSNorm modules and its attention's `rope` run one C++ op each instead of
a chain of small eager ops; outside, the modules are their plain selves. The ops compute in fp32 and
round once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from sparrow.kernels.ops import CPU

from ...model.llama import RMSNorm, SelfAttention, apply_rope


def cpu_layers_available(model: nn.Module) -> bool:
    w = next(model.parameters())
    return CPU.layers_usable(w)


class CpuLayerOps:
    def __init__(self, model: nn.Module):
        self.norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        self.attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]

    @contextmanager
    def active(self) -> Iterator[None]:
        for m in self.norms:
            m.forward = _rms_norm(m)
        for m in self.attentions:
            m.rope = _rope
        try:
            yield
        finally:
            for m in self.norms:
                del m.forward
            for m in self.attentions:
                del m.rope


def _rms_norm(module: RMSNorm):
    def forward(x: Tensor) -> Tensor:
        return CPU.rms_norm(x, module.weight, module.eps)

    return forward


def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    if q.shape[2] != 1:  # the op is for one decode token per row
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return CPU.rope_qk(q, k, cos, sin)
