"""The engine's `Attention` objects over the paged pool: our decoder calls them once per layer with
post-RoPE q, k, v; the kernels are those of the ops object the runner holds.

`PrefillAttention`: one forward of a prefill (dense). Rows from position 0 attend causally to themselves;
a later chunk of a long row (`history`) attends to the prefix earlier chunks wrote. Every row's keys and
values are scattered into the pages with their centroids; a preempted sample's recompute (`Recompute`)
writes its generated positions as decoding wrote them (running-mean centroids) and attends at the
budgets its decode steps had. `DecodeAttention`: one new token per running sequence, appended to its page,
then dense paged attention or, in sparse layers, block top-k selection and attention over the kept pages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sparrow.kernels.ops import TORCH, TorchOps, write_prefill

from ..model.llama import AttentionContext
from .kv_cache import PagedKVCache
from .sparse import block_topk_sdpa

KeyTap = Callable[[int, Tensor, Tensor, Tensor], None]


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
class QueryCapture:
    """A prefill row's last queries kept for an eviction policy: the queries of columns `cols` [n] of row
    `row` of the forward go to rows `rows` [n] (position mod window) of `dest` [layers, W, Hq, D]."""

    row: int
    cols: Tensor
    rows: Tensor
    dest: Tensor


class PrefillAttention:
    def __init__(self, cache: PagedKVCache, valid: Tensor, slots: Tensor, ops: TorchOps = TORCH,
                 recompute: Recompute | None = None, taps: list[KeyTap] = (),
                 history: Tensor | None = None, windows: list[QueryCapture] = ()):
        """valid [G, T] bool: the prompt tokens, which `write_prefill` writes; slots [N] int64, one per
        valid token in row order. `recompute`: rows that continue past their prompt. `taps`: called
        per layer with (layer, keys, values [G, Hkv, S, D], the layer's centroids) once the pages are
        written (the CPU runner copies prompts with them). `history` [1, W] int64: the block table of a
        single row that continues earlier chunks (its queries sit at the last T of the W pages'
        positions that it reaches); None: every row starts at position 0. `windows`: prompt queries an
        eviction policy keeps (compaction.py)."""
        self.cache, self.valid, self.slots, self.ops = cache, valid, slots, ops
        self.recompute, self.taps, self.history = recompute, taps, history
        self.windows = windows

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        for w in self.windows:
            w.dest[layer, w.rows] = q[w.row][:, w.cols].transpose(0, 1)  # [n, Hq, D]
        k_pages, v_pages, centroids = self.cache.layer(layer)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [G, T, Hkv, D]
        if kt.shape[0] == 1 and bool(self.valid.all()):
            kv_new, vv_new = kt[0], vt[0]
        else:
            kv_new, vv_new = kt[self.valid], vt[self.valid]
        write_prefill(k_pages, v_pages, centroids, kv_new, vv_new, self.slots)
        rc = self.recompute
        for rows, cols, slots in rc.appended if rc is not None else ():
            self.ops.append_kv(k_pages, v_pages, centroids, kt[rows, cols], vt[rows, cols], slots)
        keys, values = (k, v) if self.history is None else self._paged(k_pages, v_pages, ctx.kv_len)
        for tap in self.taps:
            tap(layer, keys, values, centroids)
        if rc is None or rc.budgets is None or layer in rc.dense_layers:
            return self._causal(q, keys, values)
        pages = centroids[rc.block_table].transpose(1, 2)  # [G, Hkv, W, D]
        return block_topk_sdpa(q, keys, values, pages, rc.positions, rc.budgets, self.cache.page_size)

    def _paged(self, k_pages: Tensor, v_pages: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The row's keys and values of positions 0..length-1 from its pages -> [1, Hkv, length, D] each."""
        return gather_positions(k_pages, self.history[0], length), gather_positions(v_pages, self.history[0],
                                                                                    length)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if k.shape[2] != q.shape[2]:
            return attend_after_prefix(q, k, v)
        return self.ops.causal_attention(q, k, v)


class VerifyAttention:
    """A speculative cycle's dense verification (engine/speculative.py): row j's fed tokens (the columns
    `valid[j]` marks) continue the prefix in its pages. Their keys and values are written over the drafts'
    (centroids recomputed), then each fed token attends as a decode query of its own whose cache ends at
    its position: `decode` is the runner's dense decode attention over those queries, one row per valid
    (row, column), in row order, with slots < 0 (it writes nothing), so the device's decode kernels, and on
    a CPU the cascade over a shared prompt, serve the verification too. valid [G, T] bool, slots [N]
    int64 (one per valid token)."""

    def __init__(self, cache: PagedKVCache, valid: Tensor, slots: Tensor, decode: DecodeAttention):
        self.cache, self.valid, self.slots, self.decode = cache, valid, slots, decode

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        k_pages, v_pages, centroids = self.cache.layer(layer)
        kt, vt = k.transpose(1, 2)[self.valid], v.transpose(1, 2)[self.valid]  # [N, Hkv, D]
        write_prefill(k_pages, v_pages, centroids, kt, vt, self.slots)
        qt = q.transpose(1, 2)  # [G, T, Hq, D]
        out = self.decode(layer, qt[self.valid][:, :, None], kt[:, :, None], vt[:, :, None], ctx)
        full = torch.zeros_like(qt)
        full[self.valid] = out[:, :, 0].to(q.dtype)
        return full.transpose(1, 2)


def gather_positions(pages: Tensor, table: Tensor, length: int) -> Tensor:
    """Pool pages [N, Hkv, P, D] along a block table [W] -> positions 0..length-1 [1, Hkv, length, D]."""
    g = pages[table]  # [W, Hkv, P, D]
    return g.transpose(0, 1).reshape(1, g.shape[1], -1, g.shape[3])[:, :, :length]


def attend_after_prefix(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [1, Hq, T, D] at the last T of the S positions of k, v [1, Hkv, S, D]: each query sees the keys
    up to its own position (causal, aligned to the lower right). The keys are repeated per query head
    rather than passed with `enable_gqa`, so that CUDA takes its flash or memory-efficient kernel (no
    [T, S] scores)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: only when needed

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


@dataclass
class KeptPages:
    """Pages a step keeps for the steps after it (a speculative cycle's drafts, static_decode.py): pages
    [L, B, Hkv, K + 1] int32 logical pages per layer (-1 = none). `store`: this step selects in each sparse
    layer and writes its selection there; else it attends to the pages there without selecting."""

    pages: Tensor
    store: bool


@dataclass
class DecodeBatch:
    """The per-step inputs of a decode step: block_table [B, max_pages] int32 (-1 unused), seq_lens [B]
    int32 (the cached tokens including the new one: under eviction fewer than its position + 1), budgets
    [B] int32 (0 = dense), slots [B] int64 (where the new token's k/v go; < 0: a padding row that writes
    nothing). `any_sparse`: some row has a budget (given, so that no layer reads it back from the
    device). `max_selected`: a bound on the kept pages, so that selection needs no device-to-host sync
    (CUDA graphs need that). `query_index` [B] int64: the row of the pool's query ring each row's query
    goes to (eviction, compaction.py), or None when the pool has no ring. `groups` [B + 1] int32 (a dense
    step only): consecutive rows that are queries of one sequence, at most `queries_per_group` each (a
    speculative verification's fed tokens), whose pages a kernel may read once for the group. `kept`:
    the sparse layers' pages, kept by this step or kept earlier (`KeptPages`)."""

    block_table: Tensor
    seq_lens: Tensor
    budgets: Tensor
    slots: Tensor
    any_sparse: bool
    max_selected: int | None = None
    query_index: Tensor | None = None
    groups: Tensor | None = None
    queries_per_group: int = 1
    kept: KeptPages | None = None


class DecodeAttention:
    def __init__(self, cache: PagedKVCache, batch: DecodeBatch, dense_layers: Collection[int], scale: float,
                 ops: TorchOps = TORCH):
        self.cache, self.batch, self.scale, self.ops = cache, batch, scale, ops
        self.dense_layers = frozenset(dense_layers)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        k_pages, v_pages, centroids = self.cache.layer(layer)
        self.ops.append_kv(k_pages, v_pages, centroids, k[:, :, 0], v[:, :, 0], self.batch.slots)
        return self.attend(layer, q[:, :, 0])[:, :, None]

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """q [B, Hq, D] (post-RoPE, this step's k/v already appended) -> [B, Hq, D] in q's dtype: the
        selection and attention half of a layer, which the GPU's fused decode layer calls directly."""
        ops, b = self.ops, self.batch
        self.record_queries(layer, q)
        k_pages, v_pages, centroids = self.cache.layer(layer)
        if b.any_sparse and layer not in self.dense_layers:
            selected = self.selection(layer, q, centroids)
            out = ops.sparse_paged_attention(q, k_pages, v_pages, b.block_table, b.seq_lens, selected,
                                             self.scale)
        else:
            out = ops.dense_paged_attention(q, k_pages, v_pages, b.block_table, b.seq_lens, self.scale,
                                            groups=b.groups, queries_per_group=b.queries_per_group)
        return out.to(q.dtype)

    def selection(self, layer: int, q: Tensor, centroids: Tensor) -> Tensor:
        """The logical pages a sparse layer attends to [B, Hkv, K]: block top-k of q, or the kept ones."""
        b, kept = self.batch, self.batch.kept
        if kept is not None and not kept.store:
            return kept.pages[layer]
        selected = self.ops.select_pages(q, centroids, b.block_table, b.seq_lens, b.budgets,
                                         page_size=self.cache.page_size, max_selected=b.max_selected)
        if kept is not None:
            kept.pages[layer, :, :, : selected.shape[2]].copy_(selected)
        return selected

    def record_queries(self, layer: int, q: Tensor) -> None:
        """Each row's post-RoPE query q [B, Hq, D] into its row of the pool's query ring (one index copy:
        a static input, so CUDA graphs replay it)."""
        if self.batch.query_index is not None:
            self.cache.queries[layer].index_copy_(0, self.batch.query_index, q)
