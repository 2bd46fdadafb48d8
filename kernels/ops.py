"""The paged-KV ops of kernels/CONTRACT.md, one ops object per backend, picked once by `ops_for`.

`TORCH` runs the torch references; `CPU` the C++ kernels of kernels/cpu_attention.py and
kernels/cpu_sampling.py where they build and take the tensors (else the reference), and the CPU's fused
layer ops; `TRITON` the Triton kernels (on CPU tensors only under `TRITON_INTERPRET=1`). They share
method names and signatures, so a runner holds one and no call names a backend. Layout (per layer):
k_pages, v_pages [num_pages_total, Hkv, P, D]; centroids [num_pages_total, Hkv, D] float32; block_table
[B, max_pages] int32 physical page ids (-1 unused); seq_lens [B] int32 including the token being decoded.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_attention, cpu_sampling
from ._triton_utils import HAS_TRITON, interpreter_usable
from .add_rms_norm import add_rms_norm_reference, add_rms_norm_triton
from .append_kv import append_kv_reference, append_kv_triton, write_prefill
from .cascade_decode import CascadeRows, cascade_page_scores
from .dense_decode import dense_decode_reference, dense_decode_triton
from .page_scoring import (
    finish_selection,
    page_scores_reference,
    page_scores_triton,
    page_scoring_reference,
    page_scoring_triton,
)
from .qk_norm_rope_append import qk_norm_rope_append_reference, qk_norm_rope_append_triton
from .race_sample import race_sample_torch, race_sample_triton, row_seeds
from .silu_mul import silu_mul_reference, silu_mul_triton
from .sparse_decode import GatherWorkspace, sparse_decode_reference, sparse_decode_triton
from .sparse_prefill import sparse_prefill_reference, sparse_prefill_triton

__all__ = ["CPU", "TORCH", "TRITON", "Backend", "CpuOps", "GatherWorkspace", "HAS_TRITON", "TorchOps",
           "TritonOps", "draw_seeds", "finish_selection", "host_race", "host_race_usable", "ops_for",
           "write_prefill"]


class Backend(enum.Enum):
    """Which kernels run the ops: AUTO picks Triton on CUDA and the C++ kernels on a CPU (each where it
    runs, else the torch reference); TRITON forces the Triton kernels (on CPU tensors only under
    TRITON_INTERPRET=1); TORCH forces the torch references."""

    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


class TorchOps:
    """The torch references of every op."""

    backend = Backend.TORCH

    def append_kv(self, k_pages: Tensor, v_pages: Tensor, centroids: Tensor, k: Tensor, v: Tensor,
                  slots: Tensor) -> None:
        """Write one token per row (k, v [N, Hkv, D]) at physical slots [N] (page * P + offset; < 0
        skipped) and update the pages' centroids incrementally, in place. Rows must target distinct pages."""
        append_kv_reference(k_pages, v_pages, centroids, k, v, slots)

    def add_rms_norm(self, x: Tensor | None, residual: Tensor, weight: Tensor, eps: float,
                     out: Tensor | None = None) -> Tensor:
        """residual [N, H] += x in place (x None: no add) -> RMSNorm(residual) [N, H] (into `out` if
        given), with the eager modules' rounding points (kernels/add_rms_norm.py)."""
        normed = add_rms_norm_reference(x, residual, weight, eps)
        return normed if out is None else out.copy_(normed)

    def qk_norm_rope_append(self, *args) -> Tensor:
        """A decode step's stacked q/k/v rows [N, (Hq + 2 Hkv) D] -> rotated queries [N, Hq, D]; the keys
        (normed, rotated) and values appended with their pages' centroids updated, as `append_kv`
        (arguments as kernels/qk_norm_rope_append.py's)."""
        return qk_norm_rope_append_reference(*args)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """[N, 2I] stacked gate/up products -> silu(gate) * up [N, I] (kernels/silu_mul.py)."""
        return silu_mul_reference(gate_up)

    def page_scores(self, q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                    page_size: int = 16) -> Tensor:
        """[B, Hkv, max_pages] fp32 candidate-page scores (-inf for reserved pages and pages past the end)."""
        return page_scores_reference(q, centroids, block_table, seq_lens, page_size)

    def select_pages(self, q: Tensor, centroids: Tensor, block_table: Tensor, seq_lens: Tensor,
                     budgets: Tensor, page_size: int = 16, max_selected: int | None = None) -> Tensor:
        """Block top-k selection -> [B, Hkv, K] int32 logical pages, sorted ascending, padded with -1. K =
        max kept pages over the batch (a host sync), or `max_selected` when given (no sync; it must be at
        least that maximum, e.g. max(budget) / P, or max_pages when a request may be dense)."""
        return page_scoring_reference(q, centroids, block_table, seq_lens, budgets, page_size, max_selected)

    def cascade_select_pages(self, q: Tensor, rows: CascadeRows, centroids: Tensor, block_table: Tensor,
                             seq_lens: Tensor, budgets: Tensor, page_size: int = 16,
                             max_selected: int | None = None) -> Tensor:
        """Block top-k selection in a cascade step: the shared prefixes' centroids scored once for their
        rows, each row's own pages (`rows.suffix`) through the block table."""
        plan, index = rows.plan_and_index() if rows.plan_and_index is not None else (None, None)
        scores = cascade_page_scores(q, rows.prefixes, centroids, block_table, seq_lens, rows.suffix,
                                     page_size, plan, index)
        return finish_selection(scores, seq_lens, budgets, page_size, max_selected, plan)

    def sparse_paged_attention(self, q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                               seq_lens: Tensor, selected: Tensor, scale: float | None = None,
                               num_splits: int | None = None, workspace: GatherWorkspace | None = None,
                               ) -> Tensor:
        """Exact softmax attention over the tokens of the selected logical pages -> [B, Hq, D].
        `workspace`: reused gather buffers for the torch path (the kernels need none)."""
        return sparse_decode_reference(q, k_pages, v_pages, block_table, seq_lens, selected, scale, workspace)

    def dense_paged_attention(self, q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                              seq_lens: Tensor, scale: float | None = None, num_splits: int | None = None,
                              workspace: GatherWorkspace | None = None, groups: Tensor | None = None,
                              queries_per_group: int = 1) -> Tensor:
        """Exact softmax attention over all cached tokens (positions < seq_len) -> [B, Hq, D]. `groups`
        [B + 1]: consecutive rows that are queries of one sequence (at most `queries_per_group` each),
        which a kernel may read the pages of once; the result is each row's own attention either way."""
        return dense_decode_reference(q, k_pages, v_pages, block_table, seq_lens, scale, workspace)

    def sparse_prefill_attention(self, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                                 kept: Tensor, page_size: int = 16, scale: float | None = None) -> Tensor:
        """Teacher-forced block-sparse attention of one sequence's queries q [C, Hq, D] at `positions` [C]
        over its keys/values [Hkv, S, D], each query over the pages `kept` [C, Hkv, ceil(S / P)] uint8
        marks, up to its position -> [C, Hq, D]."""
        return sparse_prefill_reference(q, keys, values, positions, kept, page_size, scale)

    def causal_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """A prefill's causal attention, q [B, Hq, T, D] over k, v [B, Hkv, T, D] -> [B, Hq, T, D]."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    @staticmethod
    def fused_layer_usable(q: Tensor, k_pages: Tensor, centroids: Tensor, k: Tensor) -> bool:
        """Whether a sparse decode layer runs as one op (`CpuOps.sparse_decode_layer`) for these tensors."""
        return False

    def race_sample(self, logp: Tensor, seeds: Tensor, positions: Tensor | None = None) -> Tensor:
        """Draw one token per row -> [B] int64 on logp's device, without a host sync. `seeds` are row
        seeds, or with `positions` the samples' seeds keyed by position (`row_seeds`)."""
        return race_sample_torch(logp, seeds.long() if positions is None else row_seeds(seeds, positions))


class CpuOps(TorchOps):
    """The C++ kernels where they build and take the tensors, else the references; and the CPU's layer ops
    (norms, rotary embedding, packed products, the fused decode layer halves)."""

    backend = Backend.AUTO

    def append_kv(self, k_pages, v_pages, centroids, k, v, slots) -> None:
        if cpu_attention.append_kv_usable(k_pages, centroids, k):
            cpu_attention.append_kv(k_pages, v_pages, centroids, k, v, slots)
        else:
            append_kv_reference(k_pages, v_pages, centroids, k, v, slots)

    def select_pages(self, q, centroids, block_table, seq_lens, budgets, page_size=16, max_selected=None):
        if q.device.type == "cpu" and cpu_attention.available():
            scores = page_scores_reference(q, centroids, block_table, seq_lens, page_size)
            return cpu_attention.select_pages(scores, seq_lens, budgets, page_size, max_selected)
        return super().select_pages(q, centroids, block_table, seq_lens, budgets, page_size, max_selected)

    def cascade_select_pages(self, q, rows, centroids, block_table, seq_lens, budgets, page_size=16,
                             max_selected=None):
        if q.device.type == "cpu" and q.shape[-1] % 16 == 0 and cpu_attention.available():
            scores = cpu_attention.score_pages(q, [c for _, c in rows.prefixes], rows.group, centroids,
                                               block_table, seq_lens, page_size)
            return cpu_attention.select_pages(scores, seq_lens, budgets, page_size, max_selected)
        return super().cascade_select_pages(q, rows, centroids, block_table, seq_lens, budgets, page_size,
                                            max_selected)

    def sparse_paged_attention(self, q, k_pages, v_pages, block_table, seq_lens, selected, scale=None,
                               num_splits=None, workspace=None):
        if not cpu_attention.usable(q, k_pages):
            return sparse_decode_reference(q, k_pages, v_pages, block_table, seq_lens, selected, scale,
                                           workspace)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seq_lens, selected,
                                             scale)[0].to(q.dtype)

    def dense_paged_attention(self, q, k_pages, v_pages, block_table, seq_lens, scale=None, num_splits=None,
                              workspace=None, groups=None, queries_per_group=1):
        if not cpu_attention.usable(q, k_pages):
            return dense_decode_reference(q, k_pages, v_pages, block_table, seq_lens, scale, workspace)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        every = torch.arange(block_table.shape[1])[None, None, :].expand(q.shape[0], k_pages.shape[1], -1)
        return cpu_attention.paged_attention(q, k_pages, v_pages, block_table, seq_lens, every,
                                             scale)[0].to(q.dtype)

    def causal_attention(self, q, k, v):
        if cpu_attention.causal_attention_usable(q, k):
            return cpu_attention.causal_attention(q, k, v, q.shape[-1] ** -0.5)
        return super().causal_attention(q, k, v)

    def race_sample(self, logp, seeds, positions=None):
        row = seeds.long() if positions is None else row_seeds(seeds, positions)
        usable = cpu_sampling.usable(logp)
        return cpu_sampling.race_sample(logp, row) if usable else race_sample_torch(logp, row)

    # the CPU's layer ops (C++, kernels/cpu_*.cpp): arguments as their registered schemas

    @staticmethod
    def layers_usable(weight: Tensor) -> bool:
        """Whether the C++ layer ops run for a model with this weight."""
        return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and cpu_attention.available())

    @staticmethod
    def fused_layer_usable(q, k_pages, centroids, k):
        return (q.shape[-1] % 16 == 0 and cpu_attention.usable(q, k_pages)
                and cpu_attention.append_kv_usable(k_pages, centroids, k))

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.ops.sparrow_cpu.rms_norm(x, weight, eps)

    def rope_qk(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ops.sparrow_cpu.rope_qk(q, k, cos, sin)

    def packed_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, fp32_out: bool) -> Tensor:
        return torch.ops.sparrow_cpu.packed_linear(x, weight, bias, fp32_out)

    def decode_qkv(self, *args) -> tuple[Tensor, Tensor, Tensor]:
        return torch.ops.sparrow_cpu.decode_qkv(*args)

    def decode_mlp(self, *args) -> Tensor:
        return torch.ops.sparrow_cpu.decode_mlp(*args)

    def sparse_decode_layer(self, *args) -> Tensor:
        """A sparse cascade layer's append, scoring, selection and paged attention in one op."""
        return torch.ops.sparrow_cpu.sparse_decode_layer(*args)


class TritonOps(TorchOps):
    """The Triton kernels (write_prefill and the cascade's selection stay the references)."""

    backend = Backend.TRITON

    def append_kv(self, k_pages, v_pages, centroids, k, v, slots) -> None:
        append_kv_triton(k_pages, v_pages, centroids, k, v, slots)

    def add_rms_norm(self, x, residual, weight, eps, out=None):
        return add_rms_norm_triton(x, residual, weight, eps, out)

    def qk_norm_rope_append(self, *args):
        return qk_norm_rope_append_triton(*args)

    def silu_mul(self, gate_up):
        return silu_mul_triton(gate_up)

    def page_scores(self, q, centroids, block_table, seq_lens, page_size=16):
        return page_scores_triton(q, centroids, block_table, seq_lens, page_size)

    def select_pages(self, q, centroids, block_table, seq_lens, budgets, page_size=16, max_selected=None):
        return page_scoring_triton(q, centroids, block_table, seq_lens, budgets, page_size, max_selected)

    def sparse_paged_attention(self, q, k_pages, v_pages, block_table, seq_lens, selected, scale=None,
                               num_splits=None, workspace=None):
        return sparse_decode_triton(q, k_pages, v_pages, block_table, seq_lens, selected, scale,
                                    num_splits=num_splits)

    def dense_paged_attention(self, q, k_pages, v_pages, block_table, seq_lens, scale=None, num_splits=None,
                              workspace=None, groups=None, queries_per_group=1):
        return dense_decode_triton(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits=num_splits,
                                   groups=groups, queries_per_group=queries_per_group)

    def sparse_prefill_attention(self, q, keys, values, positions, kept, page_size=16, scale=None):
        return sparse_prefill_triton(q, keys, values, positions, kept, page_size, scale)

    def race_sample(self, logp, seeds, positions=None):
        return race_sample_triton(logp, seeds, positions)


TORCH, CPU, TRITON = TorchOps(), CpuOps(), TritonOps()


def ops_for(device: torch.device | str, backend: Backend = Backend.AUTO) -> TorchOps:
    """The ops object for tensors on `device`: AUTO is Triton on CUDA (where triton is installed), the
    C++ kernels on a CPU, else the references."""
    device = torch.device(device)
    if backend == Backend.TORCH:
        return TORCH
    if backend == Backend.TRITON:
        if not HAS_TRITON:
            raise RuntimeError("Backend.TRITON but triton is not installed")
        if device.type != "cuda" and not interpreter_usable():
            raise RuntimeError("Backend.TRITON on CPU tensors needs TRITON_INTERPRET=1, set before triton is "
                               "first imported in the process")
        return TRITON
    if device.type == "cuda":
        return TRITON if HAS_TRITON else TORCH
    return CPU if device.type == "cpu" else TORCH


# the plain step's host sampling: the C++ race with one seed per row drawn from each sample's generator
host_race_usable = cpu_sampling.usable
host_race = cpu_sampling.race_sample
draw_seeds = cpu_sampling.draw_seeds
