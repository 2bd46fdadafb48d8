"""`SparseAttention`: block top-k attention as a pluggable `Attention` for our decoder.

One object serves both forms. Decode: T = 1 new token per request, keys come from the KV cache.
Teacher forced: the whole sequence at once, every query selecting its own pages from its own causal
prefix. Where the Triton kernels run (CUDA) the engine's selection kernels pick each query's pages and
the block-sparse prefill kernel attends (`sparse_paged.block_topk_paged`); elsewhere `block_topk_sdpa`,
the torch reference, processes the queries in chunks so that the [T, S] masks and scores stay bounded
for 8K sequences. The choice is made once per object, from the budgets' device.
Per-query budgets make schedules exact: the budget of the step whose query sits at
position t is the schedule's budget at cache length t + 1. Prompt (prefill) queries and the layers in
`dense_layers` get budget 0, i.e. dense.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.definitions import DEFAULT_DENSE_LAYERS, PAGE_SIZE
from ..model.llama import AttentionContext, DenseAttention, cached_kv, masked_attention
from .block_topk import kept_page_mask, kept_token_mask, page_centroids
from .sparse_paged import block_topk_paged, paged_scoring_usable


class SparseAttention:
    needs_gradients = False  # True: gradients flow through it: the torch path (the kernels have no backward)

    def __init__(self, budgets: Tensor, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                 page: int = PAGE_SIZE, chunk_elements: int = 1 << 25, over_cached: bool = False):
        """budgets [B, T]: token budget of each new query (0 = dense); [B] or [B, 1] for decode.
        `over_cached`: the queries attend to the keys and values already in the cache at their positions
        and write none of their own (a speculative draft's view of the dense KV that verification keeps)."""
        self.over_cached = over_cached
        self.budgets = budgets if budgets.dim() == 2 else budgets[:, None]
        self.dense_layers = set(dense_layers)
        self.page = page
        self.chunk_elements = chunk_elements  # bounds the torch path's [B, Hq, chunk, S] scores per chunk
        self._dense = DenseAttention()
        # read back once here, so that no layer syncs with the device for them
        self.any_sparse = bool((self.budgets > 0).any())
        self.paged = paged_scoring_usable(self.budgets.device) and not self.needs_gradients
        self.widest = kept_pages_bound(self.budgets, page) if self.paged and self.any_sparse else None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        if self.over_cached:
            keys, values = ctx.cache.k[layer, :, :, : ctx.kv_len], ctx.cache.v[layer, :, :, : ctx.kv_len]
            if layer in self.dense_layers or not self.any_sparse:
                return masked_attention(q, keys, values, ctx.positions)
        elif layer in self.dense_layers or not self.any_sparse:
            return self._dense(layer, q, k, v, ctx)
        else:
            keys, values = cached_kv(layer, k, v, ctx)  # [B, Hkv, S, D]
        return self.attend(q, keys, values, ctx.positions)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
        """Block top-k attention of q [B, Hq, T, D] at `positions` [B, T] over keys/values
        [B, Hkv, S, D] whose slot i holds position i, centroids computed from those keys."""
        budgets = self.budgets.expand(q.shape[0], q.shape[2])
        centroids = page_centroids(keys, self.page)
        if self.paged:
            return block_topk_paged(q, keys, values, centroids, positions, budgets, self.widest, self.page)
        return block_topk_sdpa(q, keys, values, centroids, positions, budgets, self.page,
                               self.chunk_elements)


def kept_pages_bound(budgets: Tensor, page: int = PAGE_SIZE) -> int | None:
    """The most pages any query of `budgets` keeps (its largest budget / page), or None when some query
    is dense (budget 0) and may keep them all."""
    if bool((budgets == 0).any()):
        return None
    return int(budgets.max()) // page


def block_topk_sdpa(q: Tensor, keys: Tensor, values: Tensor, centroids: Tensor, positions: Tensor,
                    budgets: Tensor, page: int = PAGE_SIZE, chunk_elements: int = 1 << 25) -> Tensor:
    """Every query attends to the pages it keeps under the block top-k rule, in chunks of queries.

    q [B, Hq, T, D]; keys, values [B, Hkv, S, D] (position s at index s); centroids [B, Hkv, ceil(S/page),
    D], the scores' page means (the caller decides how they were computed); positions, budgets [B, T].
    """
    hq, hkv = q.shape[1], keys.shape[1]
    b, t, s = q.shape[0], q.shape[2], keys.shape[2]
    chunk = max(16, min(t, chunk_elements // (b * hq * s)))
    out = []
    for start in range(0, t, chunk):
        pos = positions[:, start:start + chunk]
        kv_hi = int(pos.max()) + 1  # keys past the chunk's last query are never visible
        pages = kept_page_mask(q[:, :, start:start + chunk].to(centroids.dtype), centroids, pos,
                               budgets[:, start:start + chunk], page)
        mask = kept_token_mask(pages, pos, kv_hi, page)  # [B, Hkv, chunk, kv_hi]
        mask = mask.repeat_interleave(hq // hkv, dim=1)
        out.append(F.scaled_dot_product_attention(
            q[:, :, start:start + chunk], keys[:, :, :kv_hi], values[:, :, :kv_hi],
            attn_mask=mask, enable_gqa=True))
    return torch.cat(out, dim=2)
