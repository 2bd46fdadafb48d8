"""Linear layers prepacked for oneDNN, for the CPU decode step (fp32 and bf16).

A decode step multiplies a few rows (one per running sample) by every weight matrix of the model.
Called on a plain bf16 weight, oneDNN first reorders the weight into its blocked layout, on every call:
for SmolLM2's 576x1536 MLP weight at 8 rows that doubled the time of the product (0.59 vs 0.29 ms, one
thread). A plain fp32 weight goes to MKL's sgemm, which on this AMD CPU ran 2.6x slower than oneDNN on
a packed copy (0.65 vs 0.25 ms, two threads; the results agree to fp32 rounding). `PackedLinears`
keeps each nn.Linear's weight reordered once (`mkldnn._reorder_linear_weight`) and, inside `active()`,
routes the module's forward to `mkldnn._linear_pointwise` on the packed copy.

The packed copies are refreshed whenever a weight changed since it was packed (its tensor version
counter moved, as after an in-place LoRA merge or an optimizer step, or it was replaced), so the engine
always samples with the current weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def packing_available(model: nn.Module) -> bool:
    """fp32 or bf16 weights on a CPU whose torch has oneDNN's packed linear."""
    w = next(model.parameters())
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinears:
    def __init__(self, model: nn.Module, batch_hint: int):
        self.linears = [m for m in model.modules() if type(m) is nn.Linear]
        self.batch_hint = batch_hint
        self.packed: dict[int, Tensor] = {}
        self.stamps: dict[int, tuple[int, int]] = {}

    def refresh(self) -> None:
        """Repack the weights that changed since they were packed."""
        for m in self.linears:
            stamp = (m.weight.data_ptr(), m.weight._version)
            if self.stamps.get(id(m)) != stamp:
                weight = m.weight.detach()
                self.packed[id(m)] = torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)
                self.stamps[id(m)] = stamp

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: every nn.Linear of the model computes with its packed weight."""
        self.refresh()
        for m in self.linears:
            m.forward = _packed_forward(self.packed[id(m)], m.bias)
        try:
            yield
        finally:
            for m in self.linears:
                del m.forward


def _packed_forward(packed: Tensor, bias: Tensor | None):
    def forward(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward
