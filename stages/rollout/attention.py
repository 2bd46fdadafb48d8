"""The engine's `Attention` objects: our decoder calls them once per layer with post-RoPE q, k, v.

`PrefillAttention`: prompts (right-padded to one length) attend causally to themselves (prefill is
dense): on a CPU with the C++ kernels through ours (`cpu_attention.causal_attention`; at 6K tokens 2.2x
PyTorch's flash kernel in bf16, 1.3x in fp32), else plain SDPA; their keys/values are scattered into the pages
(`ops.write_prefill`, which also sets the page centroids). A row may also be a preempted sample's
recompute (`Recompute`): its generated positions are written as decoding wrote them, one `ops.append_kv`
per page offset in order, so the centroids are the same running means (of complete and partial pages)
and not write_prefill's sums; and each generated query attends as its decode step did, by the block
top-k rule at the budget that step had (`block_topk_sdpa` over the cache's centroids: the pages it
scores were complete at that step, so their centroids then were what they are now).
`DecodeAttention`: one new token per running sequence. Its k/v are appended to the sequence's page
(`ops.append_kv`, incremental centroid), then the query attends either to every page
(`ops.dense_paged_attention`) or, in sparse layers when some request has a budget, to the pages
chosen by block top-k (`ops.select_pages` + `ops.sparse_paged_attention`). Requests with budget 0 in a
sparse step keep all their pages, so mixed batches need no special case. On the CPU, dense attention of
samples that share a prompt's pages is cascaded (`Cascade`): the shared prefix is read once per step
for all of them (kernels/cascade_decode.py); in sparse layers the prefix's centroids are scored for all
of them with one product, and each sample then reads only the pages it selected; with the C++ kernels
such a sparse layer is one op (`sparse_decode_layer`: the same four steps, 0.7 ms less Python per step).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sparrow.kernels import cpu_attention
from sparrow.kernels.cascade_decode import cascade_decode_reference, suffix_index
from sparrow.kernels.page_scoring import plan_selection
from sparrow.kernels.sparse_decode import plan_pages

from ..attention import block_topk_sdpa
from ..definitions import RESERVED_PAGES
from ..model.llama import AttentionContext
from .kv_cache import PagedKVCache, SharedPrefix


def _ops():
    from sparrow.kernels import ops

    return ops


@dataclass
class Recompute:
    """What a prefill with recomputed rows needs beyond the prompts.

    appended: per page offset 0..P-1 that occurs, (rows, cols, slots) of the generated tokens at that
    offset: written in offset order, every page's running mean advances as in decode (each group
    touches distinct pages). budgets [G, T] int (0 = dense, prompt positions and fresh rows) or None
    when no query is sparse; positions [G, T]; block_table [G, ceil(T/P)] physical pages (>= 0)."""

    appended: list[tuple[Tensor, Tensor, Tensor]]
    budgets: Tensor | None
    positions: Tensor
    block_table: Tensor
    dense_layers: frozenset[int]


@dataclass
class Cascade:
    """Shared-prefix groups of a decode batch: (rows [n] int64, store) for the samples whose block
    tables start with store.pages, and the logical pages [B, Hkv, W] each row attends beyond its
    prefix (all its pages for a row in no group)."""

    groups: list[tuple[Tensor, SharedPrefix]]
    suffix: Tensor


class PrefillAttention:
    def __init__(self, cache: PagedKVCache, valid: Tensor, slots: Tensor, impl: str = "auto",
                 recompute: Recompute | None = None, prefixes: list[tuple[int, SharedPrefix]] = ()):
        """valid [G, T] bool: the prompt tokens, which `write_prefill` writes; slots [N] int64, one per
        valid token in row order. `recompute`: rows that continue past their prompt. `prefixes`:
        (row, store) pairs whose store receives the row's keys/values of its first store.tokens positions."""
        self.cache, self.valid, self.slots, self.impl = cache, valid, slots, impl
        self.recompute, self.prefixes = recompute, prefixes
        self.ops = _ops()

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        k_pages, v_pages, centroids = self.cache.layer(layer)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [G, T, Hkv, D]
        if kt.shape[0] == 1 and bool(self.valid.all()):
            kv_new, vv_new = kt[0], vt[0]
        else:
            kv_new, vv_new = kt[self.valid], vt[self.valid]
        self.ops.write_prefill(k_pages, v_pages, centroids, kv_new, vv_new, self.slots)
        for row, prefix in self.prefixes:
            t = prefix.tokens
            prefix.store(layer, k[row, :, :t], v[row, :, :t], centroids[list(prefix.pages)])
        rc = self.recompute
        if rc is None:
            return self._causal(q, k, v)
        for rows, cols, slots in rc.appended:
            self.ops.append_kv(k_pages, v_pages, centroids, kt[rows, cols], vt[rows, cols], slots,
                               impl=self.impl)
        if rc.budgets is None or layer in rc.dense_layers:
            return self._causal(q, k, v)
        pages = centroids[rc.block_table].transpose(1, 2)  # [G, Hkv, W, D]
        return block_topk_sdpa(q, k, v, pages, rc.positions, rc.budgets, self.cache.page_size)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.impl == "auto" and cpu_attention.causal_attention_usable(q, k):
            return cpu_attention.causal_attention(q, k, v, q.shape[-1] ** -0.5)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class DecodeAttention:
    def __init__(self, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, budgets: Tensor,
                 slots: Tensor, dense_layers: Collection[int], scale: float, impl: str = "auto",
                 any_sparse: bool | None = None, max_selected: int | None = None, workspace=None,
                 cascade: Cascade | None = None):
        """block_table [B, max_pages] int32 (-1 unused), seq_lens [B] int32 (including the new token),
        budgets [B] int32 (0 = dense), slots [B] int64 (where the new token's k/v go).
        `max_selected`: a bound on the kept pages, so that selection needs no device-to-host sync
        (the engine passes it on CUDA). `workspace`: an `ops.GatherWorkspace` for the torch path.
        `cascade`: shared-prefix groups for the dense layers (torch path only)."""
        self.cache, self.block_table, self.seq_lens = cache, block_table, seq_lens
        self.budgets, self.slots, self.scale, self.impl = budgets, slots, scale, impl
        self.dense_layers = frozenset(dense_layers)
        self.any_sparse = bool((budgets > 0).any()) if any_sparse is None else any_sparse
        self.max_selected, self.workspace, self.cascade = max_selected, workspace, cascade
        self._suffix_plan = self._selection = self._groups = self._fused = None  # per step, built once
        self.ops = _ops()

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        ops = self.ops
        k_pages, v_pages, centroids = self.cache.layer(layer)
        sparse = self.any_sparse and layer not in self.dense_layers
        if sparse and self._one_op(q, k_pages, centroids, k):
            prefixes = [p.centroids[layer] for _, p in self.cascade.groups]
            out = torch.ops.sparrow_cpu.sparse_decode_layer(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], k_pages, v_pages, centroids, self.slots, self.block_table,
                self.seq_lens, self.budgets, self.cache.page_size, RESERVED_PAGES, prefixes,
                self._row_groups(), self.scale)
            return out.view(q.shape)
        ops.append_kv(k_pages, v_pages, centroids, k[:, :, 0], v[:, :, 0], self.slots, impl=self.impl)
        q1 = q[:, :, 0]  # [B, Hq, D]
        if sparse:
            if self.cascade is not None:
                selected = self._cascaded_selection(layer, q1, centroids)
            else:
                selected = ops.select_pages(q1, centroids, self.block_table, self.seq_lens, self.budgets,
                                            page_size=self.cache.page_size, impl=self.impl,
                                            max_selected=self.max_selected)
            out = ops.sparse_paged_attention(q1, k_pages, v_pages, self.block_table, self.seq_lens,
                                             selected, self.scale, impl=self.impl, workspace=self.workspace)
        elif self.cascade is not None:
            out = self._cascaded(layer, q1, k_pages, v_pages)
        else:
            out = ops.dense_paged_attention(q1, k_pages, v_pages, self.block_table, self.seq_lens,
                                            self.scale, impl=self.impl, workspace=self.workspace)
        return out[:, :, None].to(q.dtype)

    def _one_op(self, q: Tensor, k_pages: Tensor, centroids: Tensor, k: Tensor) -> bool:
        """Whether a sparse layer of this cascade step runs as one C++ op (`sparse_decode_layer`: the
        append, scoring, selection and paged attention that the op-by-op path runs in C++ here too)."""
        if self._fused is None:
            self._fused = (self.impl == "auto" and self.cascade is not None and self.max_selected is None
                           and q.shape[-1] % 16 == 0 and cpu_attention.usable(q[:, :, 0], k_pages)
                           and cpu_attention.append_kv_usable(k_pages, centroids, k[:, :, 0]))
        return self._fused

    def _row_groups(self) -> Tensor:
        """[B] int64: the index of each row's shared prefix in the cascade's groups (-1: none)."""
        if self._groups is None:  # the same groups in every layer of the step
            self._groups = torch.full((self.seq_lens.shape[0],), -1, dtype=torch.int64)
            for g, (rows, _) in enumerate(self.cascade.groups):
                self._groups[rows] = g
        return self._groups

    def _cascaded_selection(self, layer: int, q1: Tensor, centroids: Tensor) -> Tensor:
        prefixes = [(rows, p.centroids[layer]) for rows, p in self.cascade.groups]
        return self.ops.cascade_select_pages(q1, prefixes, self._row_groups(), centroids, self.block_table,
                                             self.seq_lens, self.budgets, self.cascade.suffix,
                                             self.cache.page_size, self.max_selected, self._selection_plan,
                                             impl=self.impl)

    def _selection_plan(self):
        if self._selection is None:  # the same lengths, budgets and suffix pages in every layer of the step
            plan = plan_selection(self.seq_lens, self.budgets, self.cache.page_size,
                                  self.block_table.shape[1], self.max_selected, self.block_table)
            self._selection = plan, suffix_index(self.block_table, self.cascade.suffix)
        return self._selection

    def _cascaded(self, layer: int, q1: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        prefixes = [(rows, p.k[layer], p.v[layer]) for rows, p in self.cascade.groups]
        if self._suffix_plan is None:  # the same suffix pages in every layer of the step
            self._suffix_plan = plan_pages(self.block_table, self.seq_lens, self.cascade.suffix,
                                           k_pages.shape[1], k_pages.shape[2])
        return cascade_decode_reference(q1, prefixes, k_pages, v_pages, self.block_table, self.seq_lens,
                                        self.cascade.suffix, self.scale, self.workspace, self._suffix_plan)
