"""Teacher-forced block top-k attention on the Triton kernels: the block-sparse prefill kernel
(kernels/sparse_prefill.py) against a float64 brute force of its definition, `block_topk_paged`
(stages/attention/sparse_paged.py) against the torch reference `block_topk_sdpa`, and `score_sequences`
through it against the torch path.

The kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set when this module is imported on a
machine without CUDA; see tests/test_kernels_triton.py), compiled on CUDA. fp32 throughout, to the
teacher-forcing tolerance of tests/test_mismatch.py (1e-4): the reference scores pages in the
centroids' dtype, so in bf16 near-ties may pick different pages on either path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_here import DEVICE, in_fresh_process, needs_triton, rerun_in_fresh_process

from sparrow.kernels.sparse_prefill import (
    kept_page_bitmap,
    sparse_prefill_reference,
    sparse_prefill_triton,
    tile_blocks,
)
from sparrow.stages.attention import sparse
from sparrow.stages.attention.block_topk import page_centroids
from sparrow.stages.attention.sparse import block_topk_sdpa, kept_pages_bound
from sparrow.stages.attention.sparse_paged import block_topk_paged
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import budget_fn
from sparrow.stages.model.llama import masked_attention
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences

P = 16


def test_kept_page_bitmap_marks_the_listed_pages():
    selected = torch.tensor([[[0, 3, 4, -1], [2, -1, -1, -1]], [[-1, -1, -1, -1], [0, 1, 2, 3]]])
    kept = kept_page_bitmap(selected, 5)
    assert kept.dtype == torch.uint8 and kept.shape == (2, 2, 5)
    for c in range(2):
        for h in range(2):
            want = {int(p) for p in selected[c, h] if p >= 0}
            assert {j for j in range(5) if kept[c, h, j]} == want


def test_tile_blocks_mark_the_blocks_a_tile_keeps():
    g = torch.Generator().manual_seed(3)
    kept = (torch.rand(11, 2, 9, generator=g) < 0.15).to(torch.uint8)  # 11 rows, 9 pages: both padded
    blocks = tile_blocks(kept, tile=4, pages_per_block=2)
    assert blocks.shape == (3, 2, 5)
    for t in range(3):
        for h in range(2):
            for j in range(5):
                want = bool(kept[4 * t: 4 * t + 4, h, 2 * j: 2 * j + 2].any())
                assert bool(blocks[t, h, j]) == want


def brute_force(q, keys, values, positions, kept, page=P):
    """The kernel's definition, one query head at a time in float64: softmax over the keys s <= the
    query's position whose page it keeps; no such key -> zeros."""
    c, hq, d = q.shape
    hkv, s, _ = keys.shape
    out = torch.zeros(c, hq, d, dtype=torch.float64)
    for i in range(c):
        for h in range(hq):
            kv = h // (hq // hkv)
            seen = [j for j in range(min(int(positions[i]) + 1, s)) if kept[i, kv, j // page]]
            if seen:
                k, v = keys[kv, seen].double(), values[kv, seen].double()
                w = torch.softmax(k @ q[i, h].double() * d ** -0.5, dim=0)
                out[i, h] = w @ v
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv,d,block_rows,block_tokens", [(4, 2, 32, 16, 64), (6, 2, 16, 32, 16),
                                                             (8, 1, 64, 16, 32)])
def test_sparse_prefill_kernel_equals_brute_force(hq, hkv, d, block_rows, block_tokens, dtype):
    """Ragged and repeated positions (a padded batch repeats S - 1), S not a multiple of the page size,
    several tiles (block_rows // G positions each, G = 3 leaves a padded row), a row that keeps nothing,
    a key block no row keeps (skipped), pages kept past a row's position (masked)."""
    g = torch.Generator().manual_seed(hq * d)
    c, s = 23, 150
    q = torch.randn(c, hq, d, generator=g).to(dtype)
    keys, values = (torch.randn(hkv, s, d, generator=g).to(dtype) for _ in range(2))
    positions = torch.cat([torch.randint(0, s, (c - 4,), generator=g), torch.full((4,), s - 1)])
    kept = (torch.rand(c, hkv, -(-s // P), generator=g) < 0.4).to(torch.uint8)
    kept[3] = 0
    kept[:, :, 4:6] = 0  # tokens 64-95: no row keeps them
    q, keys, values, positions, kept = (x.to(DEVICE) for x in (q, keys, values, positions, kept))
    want = brute_force(q.cpu(), keys.cpu(), values.cpu(), positions.cpu(), kept.cpu())
    got = sparse_prefill_triton(q, keys, values, positions, kept, P, block_rows=block_rows,
                                block_tokens=block_tokens)
    ref = sparse_prefill_reference(q, keys, values, positions, kept, P)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.cpu().double(), want, atol=tol, rtol=tol)
    assert not got[3].any()  # keeps nothing: zeros


def _case(b, hq, hkv, s, t, d=16, seed=0):
    """Random q [B, Hq, T, D], keys/values [B, Hkv, S, D] and each row's last T positions, the shorter
    rows padded with position S - 1 (as `score_sequences` pads a batch: a scratch slot after every real
    one)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    keys, values = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    positions = torch.full((b, t), s - 1)
    for i in range(b):
        end, n = s - 1 - 37 * i, t - 9 * i  # rows of different lengths
        positions[i, :n] = torch.arange(end - n, end)
    return q, keys, values, positions


def _check_against_reference(q, keys, values, positions, budgets, score_elements=1 << 26):
    q, keys, values, positions, budgets = (x.to(DEVICE) for x in (q, keys, values, positions, budgets))
    centroids = page_centroids(keys, P)
    want = block_topk_sdpa(q, keys, values, centroids, positions, budgets, P)
    got = block_topk_paged(q, keys, values, centroids, positions, budgets, kept_pages_bound(budgets, P), P,
                           score_elements=score_elements)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    dense = masked_attention(q, keys, values, positions)
    sparse_rows = (budgets > 0) & ((positions + P) // P > budgets // P)  # more pages than the budget
    gap = (want - dense).abs().amax(dim=(1, 3))  # [B, T]
    assert bool((gap[sparse_rows] > 1e-3).any()), "no query dropped a page: the case checks nothing"
    assert bool((gap[~sparse_rows] <= 1e-4).all())  # the others keep every page


@needs_triton
def test_paged_equals_reference_gqa_ragged_sequences_and_dense_rows():
    """GQA 4/2, S = 150 (not a multiple of the page size: a padded copy), two sequences of different
    lengths, budgets 48 and 80 and dense (0) rows, early queries with fewer pages than their budget,
    queries in chunks of 8."""
    q, keys, values, positions = _case(b=2, hq=4, hkv=2, s=150, t=20)
    budgets = torch.tensor([48, 80, 0, 64]).repeat(5)[None].expand(2, -1).clone()
    budgets[1, :5] = 0
    _check_against_reference(q, keys, values, positions, budgets, score_elements=8 * 2 * 10)


@needs_triton
def test_paged_equals_reference_schedule_view_and_group_of_three():
    """GQA 6/2, S = 96 (the pages are a view of the keys), one sequence with queries every third position
    from 20 (two pages, under the reserved three) to 95 at a schedule's budgets (48 then 64)."""
    q, keys, values, _ = _case(b=1, hq=6, hkv=2, s=6 * P, t=26, seed=1)
    positions = torch.arange(20, 6 * P, 3)[None]
    budget_at = budget_fn(Schedule((0, 60), (48, 64)))
    budgets = torch.tensor([[budget_at(int(p) + 1) for p in positions[0]]])
    _check_against_reference(q, keys, values, positions, budgets)


@needs_triton
def test_score_sequences_paged_equals_torch_path(monkeypatch):
    """`score_sequences` on the tiny model (GQA 4/2, head dim 32, every layer sparse) with the paged path,
    against the torch path: two sequences of different lengths, a fixed budget and a schedule."""
    model = load_model("tiny-qwen3", device=DEVICE).model
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (70, 41)]
    completions = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (8, 5)]
    modes = [48, budget_fn(Schedule((0, 80), (48, 64)))]
    want = score_sequences(model, prompts, completions, modes, dense_layers=())
    calls = []
    monkeypatch.setattr(sparse, "paged_scoring_usable", lambda device: True)
    monkeypatch.setattr(sparse, "block_topk_paged",
                        lambda *a, **k: calls.append(1) or block_topk_paged(*a, **k))
    got = score_sequences(model, prompts, completions, modes, dense_layers=())
    assert len(calls) == 2 * len(modes)  # both layers of each sparse pass ran the paged path
    assert np.array_equal(got.position, want.position)
    for mode in modes:
        alpha, logp = got.sparse[mode]
        assert np.abs(logp - want.sparse[mode][1]).max() <= 1e-4
        assert np.abs(alpha - want.sparse[mode][0]).max() <= 1e-4
        assert alpha.min() < 0.999  # sparsity changed something
    assert np.abs(got.logp_dense - want.logp_dense).max() <= 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_paged_path_never_syncs_with_the_host():
    q, keys, values, positions = _case(b=2, hq=8, hkv=2, s=2000, t=1500, d=64)
    q, keys, values, positions = (x.cuda().bfloat16() if x.is_floating_point() else x.cuda()
                                  for x in (q, keys, values, positions))
    budgets = torch.full_like(positions, 256)
    centroids = page_centroids(keys, P)
    block_topk_paged(q, keys, values, centroids, positions, budgets, 256 // P, P)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_topk_paged(q, keys, values, centroids, positions, budgets, 256 // P, P, score_elements=1 << 20)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@in_fresh_process
def test_in_fresh_process(request):
    """Fallback when triton was imported before TRITON_INTERPRET=1: rerun this module in a new process."""
    rerun_in_fresh_process(request, __file__)
