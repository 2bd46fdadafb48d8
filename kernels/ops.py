"""The paged-KV ops of kernels/CONTRACT.md, dispatching between Triton kernels and torch references.

`impl="auto"` runs the Triton kernel when the tensors are on CUDA (and triton is importable); on the
CPU it runs the C++ kernels of kernels/cpu_attention.py (attention, selection, append_kv) where they
build and run, and the torch reference otherwise; `impl="triton"` forces the kernel (on CPU tensors
only under `TRITON_INTERPRET=1`), `impl="torch"` forces the reference. Layout (per layer): k_pages, v_pages
[num_pages_total, Hkv, P, D]; centroids [num_pages_total, Hkv, D] float32; block_table [B, max_pages]
int32 physical page ids (-1 unused); seq_lens [B] int32 including the token being decoded.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import Tensor

from . import cpu_attention
from ._triton_utils import HAS_TRITON, interpreter_usable
from .add_rms_norm import add_rms_norm_reference, add_rms_norm_triton
from .append_kv import append_kv_reference, append_kv_triton, write_prefill
from .cascade_decode import cascade_page_scores
from .dense_decode import dense_decode_reference, dense_decode_triton
from .page_scoring import (
    SelectionPlan,
    finish_selection,
    page_scores_reference,
    page_scores_triton,
    page_scoring_reference,
    page_scoring_triton,
)
from .qk_norm_rope_append import qk_norm_rope_append_reference, qk_norm_rope_append_triton
from .silu_mul import silu_mul_reference, silu_mul_triton
from .sparse_decode import GatherWorkspace, sparse_decode_reference, sparse_decode_triton

IMPLS = ("auto", "triton", "torch")


class Backend(enum.Enum):
    """Which kernels run the ops: AUTO picks Triton on CUDA and the C++ kernels on a CPU (each where it
    runs, else the torch reference); TRITON forces the Triton kernels (on CPU tensors only under
    TRITON_INTERPRET=1); TORCH forces the torch references."""

    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"

__all__ = [
    "Backend",
    "GatherWorkspace",
    "HAS_TRITON",
    "IMPLS",
    "add_rms_norm",
    "append_kv",
    "cascade_select_pages",
    "dense_paged_attention",
    "finish_selection",
    "page_scores",
    "qk_norm_rope_append",
    "select_pages",
    "silu_mul",
    "sparse_paged_attention",
    "use_triton",
    "write_prefill",
]


def use_triton(impl: str, tensor: Tensor) -> bool:
    """Whether an op called with `impl` on `tensor` runs the Triton kernel."""
    if impl == "torch":
        return False
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("impl='triton' but triton is not installed")
        if not tensor.is_cuda and not interpreter_usable():
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1, set before triton is "
                               "first imported in the process")
        return True
    if impl == "auto":
        return HAS_TRITON and tensor.is_cuda
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def append_kv(k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor, slots: Tensor,
              impl: str = "auto") -> None:
    """Write one token per row (k, v [N, Hkv, D]) at physical slots [N] (page * P + offset; < 0 skipped)
    and update the pages' centroids incrementally, in place. Rows must target distinct pages."""
    if use_triton(impl, k):
        append_kv_triton(k_pages, v_pages, centroids, k, v, slots)
    elif impl == "auto" and cpu_attention.append_kv_usable(k_pages, centroids, k):
        cpu_attention.append_kv(k_pages, v_pages, centroids, k, v, slots)
    else:
        append_kv_reference(k_pages, v_pages, centroids, k, v, slots)


def add_rms_norm(x: Tensor | None, residual: Tensor, weight: Tensor, eps: float, impl: str = "auto",
                 out: Tensor | None = None) -> Tensor:
    """residual [N, H] += x in place (x None: no add) -> RMSNorm(residual) [N, H] (into `out` if given),
    with the eager modules' rounding points (kernels/add_rms_norm.py)."""
    if use_triton(impl, residual):
        return add_rms_norm_triton(x, residual, weight, eps, out)
    normed = add_rms_norm_reference(x, residual, weight, eps)
    return normed if out is None else out.copy_(normed)


def qk_norm_rope_append(qkv: Tensor, positions: Tensor, slots: Tensor, cos: Tensor, sin: Tensor,
                        q_weight: Tensor | None, k_weight: Tensor | None, eps: float, k_pages: Tensor,
                        v_pages: Tensor, centroids: Tensor, num_heads: int, impl: str = "auto") -> Tensor:
    """A decode step's stacked q/k/v rows [N, (Hq + 2 Hkv) D] -> rotated queries [N, Hq, D]; the keys
    (normed, rotated) and values appended at `slots` with their pages' centroids updated, as `append_kv`
    (kernels/qk_norm_rope_append.py)."""
    if use_triton(impl, qkv):
        return qk_norm_rope_append_triton(qkv, positions, slots, cos, sin, q_weight, k_weight, eps, k_pages,
                                          v_pages, centroids, num_heads)
    return qk_norm_rope_append_reference(qkv, positions, slots, cos, sin, q_weight, k_weight, eps, k_pages,
                                         v_pages, centroids, num_heads)


def silu_mul(gate_up: Tensor, impl: str = "auto") -> Tensor:
    """[N, 2I] stacked gate/up products -> silu(gate) * up [N, I] (kernels/silu_mul.py)."""
    if use_triton(impl, gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def page_scores(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor, page_size: int = 16,
                impl: str = "auto") -> Tensor:
    """[B, Hkv, max_pages] fp32 candidate-page scores (-inf for reserved pages and pages past the end)."""
    if use_triton(impl, q):
        return page_scores_triton(q, centroids, block_table, seq_lens, page_size)
    return page_scores_reference(q, centroids, block_table, seq_lens, page_size)


def select_pages(q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor, budgets: Tensor,
                 page_size: int = 16, impl: str = "auto", max_selected: int | None = None) -> Tensor:
    """Block top-k selection -> [B, Hkv, K] int32 logical pages, sorted ascending, padded with -1.

    K = max kept pages over the batch (a host sync), or `max_selected` when given (no sync; it must be
    at least that maximum, e.g. max(budget) / P, or max_pages when a request may be dense)."""
    if use_triton(impl, q):
        return page_scoring_triton(q, centroids, block_table, seq_lens, budgets, page_size, max_selected)
    if impl == "auto" and q.device.type == "cpu" and cpu_attention.available():
        scores = page_scores_reference(q, centroids, block_table, seq_lens, page_size)
        return cpu_attention.select_pages(scores, seq_lens, budgets, page_size, max_selected)
    return page_scoring_reference(q, centroids, block_table, seq_lens, budgets, page_size, max_selected)


def cascade_select_pages(q: Tensor, prefixes: list[tuple[Tensor, Tensor]], group: Tensor, centroids: Tensor,
                         block_table: Tensor, seq_lens: Tensor, budgets: Tensor, suffix: Tensor,
                         page_size: int = 16, max_selected: int | None = None,
                         plan_and_index: Callable[[], tuple[SelectionPlan, tuple]] | None = None,
                         impl: str = "auto") -> Tensor:
    """Block top-k selection in a cascade step: the shared prefixes' centroids (rows [n], centroids
    [m, Hkv, D]) scored once for their rows, group [B] (the index of a row's prefix, -1 = none), each row's
    pages in `suffix` [B, Hkv, W] through the block table. `plan_and_index`: the step's `plan_selection`
    and `suffix_index`, built once for all layers, which only the torch reference needs."""
    if impl == "auto" and q.device.type == "cpu" and q.shape[-1] % 16 == 0 and cpu_attention.available():
        scores = cpu_attention.score_pages(q, [c for _, c in prefixes], group, centroids, block_table,
                                           seq_lens, page_size)
        return cpu_attention.select_pages(scores, seq_lens, budgets, page_size, max_selected)
    plan, index = plan_and_index() if plan_and_index is not None else (None, None)
    scores = cascade_page_scores(q, prefixes, centroids, block_table, seq_lens, suffix, page_size, plan,
                                 index)
    return finish_selection(scores, seq_lens, budgets, page_size, max_selected, plan)


def sparse_paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                           seq_lens: Tensor, selected: Tensor, scale: float | None = None,
                           impl: str = "auto", num_splits: int | None = None,
                           workspace: GatherWorkspace | None = None) -> Tensor:
    """Exact softmax attention over the tokens of the selected logical pages -> [B, Hq, D].
    `workspace`: reused gather buffers for the torch path (the kernels need none)."""
    if use_triton(impl, q):
        return sparse_decode_triton(q, k_pages, v_pages, block_table, seq_lens, selected, scale,
                                    num_splits=num_splits)
    if impl == "auto" and cpu_attention.usable(q, k_pages):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seq_lens, selected,
                                             scale)[0].to(q.dtype)
    return sparse_decode_reference(q, k_pages, v_pages, block_table, seq_lens, selected, scale, workspace)


def dense_paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                          seq_lens: Tensor, scale: float | None = None, impl: str = "auto",
                          num_splits: int | None = None, workspace: GatherWorkspace | None = None) -> Tensor:
    """Exact softmax attention over all cached tokens (positions < seq_len) -> [B, Hq, D]."""
    if use_triton(impl, q):
        return dense_decode_triton(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits=num_splits)
    if impl == "auto" and cpu_attention.usable(q, k_pages):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        every = torch.arange(block_table.shape[1])[None, None, :].expand(q.shape[0], k_pages.shape[1], -1)
        return cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seq_lens, every,
                                             scale)[0].to(q.dtype)
    return dense_decode_reference(q, k_pages, v_pages, block_table, seq_lens, scale, workspace)
