"""Cascade (shared-prefix) dense decode attention: the n samples of one prompt read its pages once.

The samples of a prompt share its full prompt pages (logical pages 0..m-1, DESIGN "paged KV"). Plain
paged decode gathers and reads those pages once per sample per step; at a 6K-token prompt and 8 samples
that is 8x the KV bytes the step needs. Cascade attention splits softmax attention at the prefix
boundary and merges the two halves exactly by their log-sum-exp:

    out = (e^{lse_p} out_p + e^{lse_s} out_s) / (e^{lse_p} + e^{lse_s}),   lse = logaddexp(lse_p, lse_s)

- prefix: the n*G query heads of every KV head (n samples x its GQA group) form the query length of
  one flash-attention call over the prefix's contiguous keys/values [Hkv, m*P, D] (a copy taken at
  prefill, so the prefix is neither gathered nor read more than once per step); no mask is needed,
  every prefix position precedes every sample's query. The CPU flash kernel parallelises over batch x
  heads x query blocks, which is Hkv = 3 work items here (SmolLM2) for 2+ threads, and it does not split
  the key length; so the prefix is cut into c equal key chunks that the call sees as c x Hkv heads
  (a view of the contiguous copy: [Hkv, S, D] = [Hkv * c, S / c, D]), and the chunks are merged by their
  log-sum-exp as the two halves are (`key_chunks` picks c, a power of two that divides S);
- suffix: each sample's own pages m.. (the copied partial prompt page and what it generated), gathered
  for the whole batch at once as in `sparse_decode.gather_pages` and attended (fp32 accumulation) with
  its log-sum-exp; a row that shares no prefix has all its pages as its suffix.
The result equals `dense_decode_reference` up to float rounding (the summation order differs). CPU
only: the GPU path keeps its flash-decoding kernel (dense_decode.py), which splits the KV length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cpu_attention import KEY_BLOCK, available, packed_prefix_attention, paged_attention, usable
from .cpu_attention import merge_attention as cpu_merge
from .page_scoring import SelectionPlan, mask_candidates
from .sparse_decode import GatherWorkspace, PagePlan, attend_gathered, gather_pages, plan_pages


@dataclass
class CascadeRows:
    """The rows of a cascade step that share prompt pages: `prefixes` (rows [n], the prefix's centroids
    [m, Hkv, D]) scored once for their rows, `group` [B] (the index of a row's prefix, -1 = none), `suffix`
    [B, Hkv, W] (each row's pages past its prefix); `plan_and_index`: the step's `plan_selection` and
    `suffix_index`, built once for all layers, which only the torch reference needs."""

    prefixes: list[tuple[Tensor, Tensor]]
    group: Tensor
    suffix: Tensor
    plan_and_index: Callable[[], tuple[SelectionPlan, tuple]] | None = None

MIN_CHUNK = 512  # keys per chunk below which more chunks cost more in merging than they gain


def key_chunks(hkv: int, length: int, threads: int | None = None) -> int:
    """How many key chunks give the flash call at least 4 work items per thread (a power of two <= 16
    that divides `length` and keeps chunks of >= MIN_CHUNK keys; 1 when none does)."""
    threads = torch.get_num_threads() if threads is None else threads
    c = 1
    while hkv * c < 4 * threads and c < 16 and length % (2 * c) == 0 and length // (2 * c) >= MIN_CHUNK:
        c *= 2
    return c


def prefix_attention(q: Tensor, prefix_k: Tensor, prefix_v: Tensor, scale: float,
                     chunks: int | None = None) -> tuple[Tensor, Tensor]:
    """q [n, Hq, D] over a shared prefix [Hkv, S, D] -> out [n, Hq, D] float32, lse [n, Hq] float32,
    the keys in `chunks` pieces (default `key_chunks`). A prefix in the packed layouts of
    kernels/cpu_attention.py (keys in blocks of 16: more than 3 dims) goes to that kernel."""
    if prefix_k.dim() > 3:
        hkv, length = prefix_k.shape[0], prefix_k.shape[1] * KEY_BLOCK
        c = key_chunks(hkv, length) if chunks is None else chunks
        return packed_prefix_attention(q, prefix_k, prefix_v, scale, c)
    n, hq, d = q.shape
    hkv, length = prefix_k.shape[:2]
    g = hq // hkv
    c = key_chunks(hkv, length) if chunks is None else chunks
    qh = q.view(n, hkv, g, d).transpose(0, 1)[:, None].expand(hkv, c, n, g, d)
    qh = qh.reshape(1, hkv * c, n * g, d).to(prefix_k.dtype)
    kv_shape = (1, hkv * c, length // c, d)  # chunk j of head h is head h * c + j
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, prefix_k.view(kv_shape), prefix_v.view(kv_shape), scale=scale)  # [1, Hkv*c, n*G, D]
    out, lse = out.view(hkv, c, n, g, d).float(), lse.view(hkv, c, n, g)
    if c > 1:
        total = torch.logsumexp(lse, 1, keepdim=True)
        out = (out * (lse - total).exp()[..., None]).sum(1)
        lse = total[:, 0]
    else:
        out, lse = out[:, 0], lse[:, 0]
    return out.transpose(0, 1).reshape(n, hq, d), lse.transpose(0, 1).reshape(n, hq)


def pages_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor,
                    pages: Tensor, scale: float, workspace: GatherWorkspace | None = None,
                    plan: PagePlan | None = None) -> tuple[Tensor, Tensor]:
    """q [B, Hq, D] over the logical pages `pages` [B, Hkv, K] (-1 = none) -> out [B, Hq, D] fp32 and
    lse [B, Hq] fp32 (-inf, with out 0, for a row with no valid position). `plan`: `plan_pages` of
    `pages`, reused across layers. Where the C++ kernel runs (kernels/cpu_attention.py), it reads the
    pages in place instead (no gather, no plan)."""
    if usable(q, k_pages):
        return paged_attention(q, k_pages, v_pages, block_table, seq_lens, pages, scale)
    plan = plan or plan_pages(block_table, seq_lens, pages, k_pages.shape[1], k_pages.shape[2])
    keys, values, valid = gather_pages(q, k_pages, v_pages, block_table, seq_lens, pages, workspace, plan)
    return attend_gathered(q, keys, values, valid, scale, plan)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Softmax attention over the union of two disjoint key sets from each half's output and lse. Where
    the C++ kernels run, row by row (`cpu_attention.merge_attention`): the same for a row whatever rows
    share the step."""
    if out_a.device.type == "cpu" and out_a.dtype == torch.float32 and available():
        return cpu_merge(out_a, lse_a, out_b, lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]


def suffix_pages(first_pages: list[int], num_pages: list[int], hkv: int, device=None) -> Tensor:
    """[B, Hkv, W] the logical pages first_pages[b]..num_pages[b]-1 of each row, padded with -1."""
    width = max(n - f for f, n in zip(first_pages, num_pages))
    j = torch.arange(width)
    first, n = torch.tensor(first_pages)[:, None], torch.tensor(num_pages)[:, None]
    pages = torch.where(first + j < n, first + j, -1)
    return pages[:, None, :].expand(-1, hkv, -1).to(device)


def cascade_decode_reference(q: Tensor, prefixes: Sequence[tuple[Tensor, Tensor, Tensor]], k_pages: Tensor,
                             v_pages: Tensor, block_table: Tensor, seq_lens: Tensor, suffix: Tensor,
                             scale: float | None = None, workspace: GatherWorkspace | None = None,
                             plan: PagePlan | None = None) -> Tensor:
    """Dense paged attention of a decode batch q [B, Hq, D] in which each (rows [n], prefix_k,
    prefix_v [Hkv, S, D]) of `prefixes` is a group of rows whose first S positions are that prefix;
    `suffix` [B, Hkv, W] holds the logical pages each row attends beyond its prefix (all of them for a
    row in no group), `plan` its `plan_pages` when the caller reuses it -> [B, Hq, D] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = pages_attention(q, k_pages, v_pages, block_table, seq_lens, suffix, scale, workspace, plan)
    for rows, prefix_k, prefix_v in prefixes:
        out_p, lse_p = prefix_attention(q[rows], prefix_k, prefix_v, scale)
        out[rows] = merge_attention(out_p, lse_p, out[rows], lse[rows])
    return out.to(q.dtype)


def suffix_index(block_table: Tensor, suffix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For scoring the suffix pages [B, Hkv, W]: their logical pages (clamped, [B, Hkv, W]), physical
    pages [B, W] and padding [B, 1, W] (the same for all layers of a step)."""
    hkv = suffix.shape[1]
    pages = suffix[:, 0].long()  # [B, W] logical (-1 = none); the same for every KV head
    phys = torch.gather(block_table.long(), 1, pages.clamp(min=0)).clamp(min=0)
    return pages.clamp(min=0)[:, None, :].expand(-1, hkv, -1), phys, (pages < 0)[:, None, :]


def cascade_page_scores(q: Tensor, prefixes: Sequence[tuple[Tensor, Tensor]], centroids: Tensor,
                        block_table: Tensor, seq_lens: Tensor, suffix: Tensor, page_size: int,
                        plan: SelectionPlan | None = None,
                        index: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """`page_scores_reference` with the shared prefixes' centroids read once: each (rows [n],
    prefix_centroids [m, Hkv, D]) scores logical pages 0..m-1 of its rows with one product, and the
    pages in `suffix` [B, Hkv, W] are gathered per row -> [B, Hkv, max_pages] fp32, -inf where not a
    candidate. `plan` (`plan_selection` with the block table) and `index` (`suffix_index`): the step's
    index work, reused across layers."""
    b, hq, d = q.shape
    hkv = centroids.shape[1]
    q_mean = q.float().view(b, hkv, hq // hkv, d).mean(2)  # [B, Hkv, D]
    scores = q_mean.new_zeros(b, hkv, block_table.shape[1])
    pages, phys, pad = index or suffix_index(block_table, suffix)
    cent = centroids[phys].float()  # [B, W, Hkv, D]
    scores.scatter_(2, pages, torch.einsum("bhd,bwhd->bhw", q_mean, cent).masked_fill(pad, 0.0))
    for rows, prefix_centroids in prefixes:
        m = prefix_centroids.shape[0]
        scores[rows, :, :m] = torch.einsum("nhd,phd->nhp", q_mean[rows], prefix_centroids)
    return mask_candidates(scores, block_table, seq_lens, page_size, plan)
