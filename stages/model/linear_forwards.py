"""Another computation for a model's plain nn.Linear layers, for the length of a `with` block: the CPU
prefill's row-exact products and bf16's fp32 products set each layer's forward on the instance and take it
back after. A layer whose forward is already set on the instance (by another such block) is left alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn


@contextmanager
def linear_forwards(model: nn.Module, forward_of: Callable[[nn.Linear], Callable[[Tensor], Tensor]]
                    ) -> Iterator[None]:
    """Within: each plain nn.Linear of `model` computes with `forward_of(layer)`."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    for m in linears:
        m.forward = forward_of(m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward
