"""Linear layers prepacked for the CPU decode step (fp32 and bf16), and the prefill's row-exact products.

A decode step multiplies a few rows by every weight; packing each weight once (oneDNN's blocked layout,
or our C++ product's where it runs, at most 16 rows) avoids a reorder per call. Projections that share an
input (q/k/v, gate/up) are packed stacked and computed as one product. Packed copies follow each weight's
version counter, so the engine always samples with the current weights.

A prefill forward stacks the rows the scheduler admitted together, so its products have as many rows as
that batch's tokens. torch's CPU product (MKL's sgemm) splits the sum over the inputs between threads
for some row counts, which rounds a row differently with other rows beside it; oneDNN's product on the
plain weight sums each row alike for any number of rows from 2 on, so `row_exact_linears` routes the
prefill's linears there (no copy of the weights); a lone row, at prefill or in a decode step on oneDNN's
packed weights, goes with a duplicate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor, nn

from sparrow.kernels.ops import CPU

from ...model.bf16_products import onednn_runs_bf16
from ...model.linear_forwards import linear_forwards


def packing_available(model: nn.Module, own_kernel: bool = True) -> bool:
    """fp32 or bf16 weights on a CPU whose torch has oneDNN's packed linear, for bf16 one whose oneDNN runs
    bf16 products (AVX512 or AVX-NE-CONVERT) or, with `own_kernel`, that runs our C++ products (an AVX2
    CPU, where oneDNN has no bf16 products: a weight ours cannot take stays as it is)."""
    w = next(model.parameters())
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (w.dtype == torch.float32 or onednn_runs_bf16() or (own_kernel and CPU.layers_usable(w))))


# methods of our model's modules that apply several linears to one input, and those linears' names
FUSIBLE = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


DOT_MAX_ROWS = 16  # the fused decode layer's rows (its products take any number)


class PackedLinears:
    def __init__(self, model: nn.Module, batch_hint: int, own_kernel: bool = True):
        """`own_kernel`: bf16 products in our C++ kernel where it runs (the CPU ops, not the references)."""
        self.batch_hint = batch_hint
        self.dot = (own_kernel and batch_hint <= DOT_MAX_ROWS
                    and next(model.parameters()).dtype in (torch.bfloat16, torch.float32)
                    and CPU.layers_usable(next(model.parameters())))
        self.groups: list[tuple[nn.Module, str, list[nn.Linear]]] = []  # (owner, method, its linears)
        for owner in model.modules():
            for method, names in FUSIBLE.items():
                members = [getattr(owner, n, None) for n in names]
                if hasattr(owner, method) and all(type(m) is nn.Linear for m in members) \
                        and len({m.bias is None for m in members}) == 1:
                    self.groups.append((owner, method, members))
        fused = {id(m) for _, _, members in self.groups for m in members}
        self.linears = [m for m in model.modules() if type(m) is nn.Linear and id(m) not in fused]
        self.packed: dict[int, tuple[str, Tensor]] = {}
        self.stamps: dict[int, tuple] = {}

    def refresh(self) -> bool:
        """Repack the weights that changed since they were packed; whether any did."""
        changed = False
        for key, members in [(id(m), [m]) for m in self.linears] + [(id(g[2][0]), g[2]) for g in self.groups]:
            stamp = tuple((m.weight.data_ptr(), m.weight._version) for m in members)
            if self.stamps.get(key) != stamp:
                weight = torch.cat([m.weight.detach() for m in members]) if len(members) > 1 \
                    else members[0].weight.detach()
                self.packed[key] = self._pack(weight)
                self.stamps[key] = stamp
                changed = True
        return changed

    def dot_weight(self, first: nn.Linear) -> Tensor | None:
        """The packed weight of a linear (or of the stacked group it leads) in our bf16 product's layout,
        None if it is not packed so (call `refresh` first)."""
        kind, weight = self.packed.get(id(first), ("", None))
        return weight if kind == "dot" else None

    def _pack(self, weight: Tensor) -> tuple[str, Tensor]:
        n, k = weight.shape
        if self.dot and n % 16 == 0 and weight.dtype == torch.float32:  # [N/16, K, 16]: cpu_layers.cpp
            return "dot", weight.view(n // 16, 16, k).transpose(1, 2).contiguous()
        if self.dot and n % 16 == 0 and k % 2 == 0:  # [N/16, K/2, 16, 2]: kernels/cpu_layers.cpp
            return "dot", weight.view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        if weight.dtype == torch.bfloat16 and not onednn_runs_bf16():
            return "plain", weight
        return "onednn", torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: every nn.Linear of the model computes with its packed weight, and the stacked
        projections of one input (q/k/v, gate/up) with one product over their stacked weights."""
        self.refresh()
        for m in self.linears:
            m.forward = _product(self.packed[id(m)], m.bias)
        for owner, method, members in self.groups:
            bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
            setattr(owner, method, _split(_product(self.packed[id(members[0])], bias),
                                          [m.out_features for m in members]))
        try:
            yield
        finally:
            for m in self.linears:
                del m.forward
            for owner, method, _ in self.groups:
                delattr(owner, method)


def row_exact_linears(model: nn.Module) -> AbstractContextManager[None]:
    """Within: every nn.Linear of the model computes through oneDNN on its own weight, each row's sums
    the same whatever rows share the call (call only where `packing_available`)."""
    return linear_forwards(model, _row_exact)


def _row_exact(linear: nn.Linear) -> Callable[[Tensor], Tensor]:
    return lambda x: _onednn_rows(x, linear.weight, linear.bias)


def _product(packed: tuple[str, Tensor], bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    kind, weight = packed
    if kind == "dot":
        return lambda x: dot_product(x, weight, bias)
    if kind == "plain":
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    return lambda x: _onednn_rows(x, weight, bias)


def _onednn_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's product (on a plain or a packed weight) sums each row alike for any number of rows from 2
    on; a lone row (a decode step of one sequence) sums in another order, so it goes with a duplicate."""
    if x.numel() != x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    pair = torch.cat([x.reshape(1, -1)] * 2)
    out = torch.ops.mkldnn._linear_pointwise(pair, weight, bias, "none", [], "")
    return out[:1].view(*x.shape[:-1], -1)


def dot_product(x: Tensor, weight: Tensor, bias: Tensor | None, fp32_out: bool = False) -> Tensor:
    """Our C++ product of rows with a weight packed for it (bf16 or fp32), in x's dtype or, with
    `fp32_out`, in fp32 (bf16 x: the sums are never rounded to bf16). Any number of rows (a speculative
    verification's K + 1 per sample): the weight is read once, each row's product the same as alone."""
    return CPU.packed_linear(x, weight, bias, fp32_out)


def _split(product: Callable[[Tensor], Tensor], sizes: list[int]) -> Callable[[Tensor], tuple[Tensor, ...]]:
    return lambda x: product(x).split(sizes, -1)
