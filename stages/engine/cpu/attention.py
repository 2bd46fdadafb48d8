"""The CPU's decode attention: reused gather buffers, cascade attention over the prompt copies, and a
sparse layer of a cascade step as one C++ op."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow.kernels.cascade_decode import CascadeRows, cascade_decode_reference, suffix_index
from sparrow.kernels.ops import CPU, TorchOps
from sparrow.kernels.page_scoring import plan_selection
from sparrow.kernels.sparse_decode import plan_pages

from ...attention.kv_cache import PagedKVCache
from ...attention.paged import DecodeAttention, DecodeBatch
from ...core.definitions import RESERVED_PAGES
from ...model.llama import AttentionContext
from .prefix_store import SharedPrefix


@dataclass
class Cascade:
    """Shared-prefix groups of a decode batch: (rows [n] int64, store) for the samples whose block
    tables start with store.pages, and the logical pages [B, Hkv, W] each row attends beyond its
    prefix (all its pages for a row in no group)."""

    groups: list[tuple[Tensor, SharedPrefix]]
    suffix: Tensor


class CpuDecodeAttention(DecodeAttention):
    def __init__(self, cache: PagedKVCache, batch: DecodeBatch, dense_layers: Collection[int], scale: float,
                 ops: TorchOps = CPU, workspace=None, cascade: Cascade | None = None):
        """`workspace`: an `ops.GatherWorkspace` for the torch references. `cascade`: shared-prefix groups
        (None: no sample reads a shared copy this step)."""
        super().__init__(cache, batch, dense_layers, scale, ops)
        self.workspace, self.cascade = workspace, cascade
        self._suffix_plan = self._selection = self._groups = self._fused = None  # per step, built once

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        ops, b = self.ops, self.batch
        self.record_queries(layer, q[:, :, 0])
        k_pages, v_pages, centroids = self.cache.layer(layer)
        sparse = b.any_sparse and layer not in self.dense_layers
        if sparse and self._one_op(q, k_pages, centroids, k):
            prefixes = [p.centroids[layer] for _, p in self.cascade.groups]
            out = ops.sparse_decode_layer(
                q[:, :, 0], k[:, :, 0], v[:, :, 0], k_pages, v_pages, centroids, b.slots, b.block_table,
                b.seq_lens, b.budgets, self.cache.page_size, RESERVED_PAGES, prefixes,
                self._row_groups(), self.scale)
            return out.view(q.shape)
        ops.append_kv(k_pages, v_pages, centroids, k[:, :, 0], v[:, :, 0], b.slots)
        q1 = q[:, :, 0]  # [B, Hq, D]
        if sparse:
            if self.cascade is not None:
                selected = self._cascaded_selection(layer, q1, centroids)
            else:
                selected = self.selection(layer, q1, centroids)
            out = ops.sparse_paged_attention(q1, k_pages, v_pages, b.block_table, b.seq_lens, selected,
                                             self.scale, workspace=self.workspace)
        elif self.cascade is not None:
            out = self._cascaded(layer, q1, k_pages, v_pages)
        else:
            out = ops.dense_paged_attention(q1, k_pages, v_pages, b.block_table, b.seq_lens, self.scale,
                                            workspace=self.workspace)
        return out[:, :, None].to(q.dtype)

    def _one_op(self, q: Tensor, k_pages: Tensor, centroids: Tensor, k: Tensor) -> bool:
        """Whether a sparse layer of this cascade step runs as one C++ op (`sparse_decode_layer`: the
        append, scoring, selection and paged attention that the op-by-op path runs in C++ here too)."""
        if self._fused is None:
            self._fused = (self.cascade is not None and self.batch.max_selected is None
                           and self.ops.fused_layer_usable(q[:, :, 0], k_pages, centroids, k[:, :, 0]))
        return self._fused

    def _row_groups(self) -> Tensor:
        """[B] int64: the index of each row's shared prefix in the cascade's groups (-1: none)."""
        if self._groups is None:  # the same groups in every layer of the step
            self._groups = torch.full((self.batch.seq_lens.shape[0],), -1, dtype=torch.int64)
            for g, (rows, _) in enumerate(self.cascade.groups):
                self._groups[rows] = g
        return self._groups

    def _cascaded_selection(self, layer: int, q1: Tensor, centroids: Tensor) -> Tensor:
        b = self.batch
        prefixes = [(rows, p.centroids[layer]) for rows, p in self.cascade.groups]
        rows = CascadeRows(prefixes, self._row_groups(), self.cascade.suffix, self._selection_plan)
        return self.ops.cascade_select_pages(q1, rows, centroids, b.block_table, b.seq_lens, b.budgets,
                                             self.cache.page_size, b.max_selected)

    def _selection_plan(self):
        b = self.batch
        if self._selection is None:  # the same lengths, budgets and suffix pages in every layer of the step
            plan = plan_selection(b.seq_lens, b.budgets, self.cache.page_size, b.block_table.shape[1],
                                  b.max_selected, b.block_table)
            self._selection = plan, suffix_index(b.block_table, self.cascade.suffix)
        return self._selection

    def _cascaded(self, layer: int, q1: Tensor, k_pages: Tensor, v_pages: Tensor) -> Tensor:
        b = self.batch
        prefixes = [(rows, p.k[layer], p.v[layer]) for rows, p in self.cascade.groups]
        if self._suffix_plan is None:  # the same suffix pages in every layer of the step
            self._suffix_plan = plan_pages(b.block_table, b.seq_lens, self.cascade.suffix,
                                           k_pages.shape[1], k_pages.shape[2])
        return cascade_decode_reference(q1, prefixes, k_pages, v_pages, b.block_table, b.seq_lens,
                                        self.cascade.suffix, self.scale, self.workspace, self._suffix_plan)
