"""Every Triton kernel of sparrow.kernels against its torch reference: under the Triton interpreter
(`TRITON_INTERPRET=1`, set when this module is imported) on a machine without CUDA, compiled on CUDA.

fp32 inputs must match the fp32 reference to 1e-4; bf16 inputs are compared with the fp32 reference
run on the same bf16-rounded inputs, to 2e-2. The unmarked tests use small shapes so `make test` runs
every kernel; the @slow ones sweep GQA ratios 1/2/3/4/8, head dims 64/128, both dtypes and budgets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Triton picks interpreter or compiler when it is first imported: set this before anything imports it
    os.environ["TRITON_INTERPRET"] = "1"

from sparrow.kernels import ops  # noqa: E402
from sparrow.kernels._triton_utils import HAS_TRITON, interpreter_usable  # noqa: E402

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from test_kernels import Cache, P  # noqa: E402  (tests/ is on sys.path: rootdir-relative test imports)

from sparrow.kernels.append_kv import append_kv_triton  # noqa: E402
from sparrow.kernels.sparse_decode import paged_decode_triton  # noqa: E402

# Some module of this session imported triton before TRITON_INTERPRET was set: the interpreter cannot
# run here, so these tests run in a fresh process instead (test_in_fresh_process).
IN_PROCESS = DEVICE == "cuda" or interpreter_usable()


@pytest.fixture(autouse=True)
def _in_process_only(request):
    if not IN_PROCESS and request.node.originalname != "test_in_fresh_process":
        pytest.skip("triton was imported without the interpreter; test_in_fresh_process runs these")


def tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def as_fp32(cache: Cache):
    """The fp32 reference inputs of a (possibly bf16) cache: the same rounded values, upcast."""
    return cache.q.float(), cache.k_pages.float(), cache.v_pages.float()


def check_attention(cache: Cache, budgets, splits=(None,), scale=None):
    cache.to(DEVICE)
    dtype = cache.q.dtype
    q32, k32, v32 = as_fp32(cache)
    budgets = budgets.to(DEVICE)
    sel = ops.TORCH.select_pages(q32, cache.centroids, cache.block_table, cache.seq_lens, budgets)
    want_sparse = ops.TORCH.sparse_paged_attention(q32, k32, v32, cache.block_table, cache.seq_lens, sel,
                                                   scale)
    want_dense = ops.TORCH.dense_paged_attention(q32, k32, v32, cache.block_table, cache.seq_lens, scale)
    for ns in splits:
        got = ops.TRITON.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                         cache.seq_lens, sel, scale, num_splits=ns)
        assert got.dtype == dtype and got.shape == cache.q.shape
        torch.testing.assert_close(got.float(), want_sparse, **tol(dtype))
        got = ops.TRITON.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                        cache.seq_lens, scale, num_splits=ns)
        torch.testing.assert_close(got.float(), want_dense, **tol(dtype))


def check_selection(cache: Cache, budgets, max_selected=None):
    cache.to(DEVICE)
    budgets = budgets.to(DEVICE)
    q = cache.q
    scores_t = ops.TRITON.page_scores(q, cache.centroids, cache.block_table, cache.seq_lens)
    scores_r = ops.TORCH.page_scores(q, cache.centroids, cache.block_table, cache.seq_lens)
    assert torch.equal(torch.isinf(scores_t), torch.isinf(scores_r))
    finite = torch.isfinite(scores_r)
    torch.testing.assert_close(scores_t[finite], scores_r[finite], atol=1e-4, rtol=1e-4)
    sel_t = ops.TRITON.select_pages(q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                             max_selected=max_selected)
    sel_r = ops.TORCH.select_pages(q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                             max_selected=max_selected)
    assert torch.equal(sel_t, sel_r)


def check_append(lengths, hq, hkv, d, dtype, shared=None, appended=5):
    got = Cache(lengths, hq, hkv, d, shared=shared, appended=appended, dtype=dtype, kernels=ops.TRITON,
                device=DEVICE)
    want = Cache(lengths, hq, hkv, d, shared=shared, appended=appended, dtype=dtype, kernels=ops.TORCH,
                 device=DEVICE)
    assert torch.equal(got.k_pages.nan_to_num(), want.k_pages.nan_to_num())
    assert torch.equal(got.v_pages.nan_to_num(), want.v_pages.nan_to_num())
    torch.testing.assert_close(got.centroids, want.centroids, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# fast: every kernel once, small shapes (part of `make test`)
# ----------------------------------------------------------------------------------------------------

def test_append_kv_triton_fast():
    check_append([5, 40, 33], hq=4, hkv=2, d=64, dtype=torch.float32, shared=(1, 2, 2), appended=4)


def test_append_kv_triton_bf16_and_padding_rows():
    check_append([17, 3], hq=2, hkv=1, d=64, dtype=torch.bfloat16, appended=4)  # row 1 pads with -1 first


def test_page_scoring_triton_fast():
    cache = Cache([5, 300, 100], hq=6, hkv=2, d=64, shared=(1, 2, 4), seed=11)
    check_selection(cache, torch.tensor([48, 64, 0], dtype=torch.int32))


def test_sparse_and_dense_decode_triton_fast():
    cache = Cache([5, 300, 70], hq=6, hkv=2, d=64, shared=(1, 2, 3), seed=12)
    check_attention(cache, torch.tensor([48, 64, 48], dtype=torch.int32), splits=(None, 1), scale=0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_dense_decode_reads_each_sequence_once(dtype):
    """A speculative verification's rows: consecutive queries of one sequence, each with its own cache
    length, in groups of at most 4 (one program per group and KV head), against float64 attention over
    the sequence's ground-truth keys; a padding row (cache 0) gives zeros, trailing groups are empty."""
    cache = Cache([70, 33, 150], hq=6, hkv=2, d=64, seed=14, dtype=dtype).to(DEVICE)
    counts = [4, 1, 3]
    seq, lims = [], []
    for i, (n, t) in enumerate(zip(cache.lengths, counts)):
        seq += [i] * t
        lims += list(range(n - t + 1, n + 1))
    seq.append(0)
    lims.append(0)  # padding
    rows = len(seq)
    groups = torch.tensor([0, 4, 5, 8, 9] + [rows] * (rows - 4), dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(rows, 6, 64, generator=g).to(dtype).to(DEVICE)
    table = cache.block_table[seq].to(DEVICE)
    out = paged_decode_triton(q, cache.k_pages, cache.v_pages, table,
                              torch.tensor(lims, dtype=torch.int32, device=DEVICE), None, scale=0.2,
                              groups=groups, queries_per_group=4)
    for r, (i, lim) in enumerate(zip(seq, lims)):
        if lim == 0:
            assert out[r].abs().max() == 0
            continue
        k = cache.keys[i][:, :lim].double().repeat_interleave(3, 0)  # [Hq, lim, D]
        v = cache.values[i][:, :lim].double().repeat_interleave(3, 0)
        w = torch.softmax(0.2 * torch.einsum("hd,hnd->hn", q[r].double().cpu(), k), -1)
        want = torch.einsum("hn,hnd->hd", w, v)
        torch.testing.assert_close(out[r].double().cpu(), want, **tol(dtype))


def test_decode_triton_bf16_fast():
    cache = Cache([37, 130], hq=4, hkv=1, d=128, seed=13, dtype=torch.bfloat16)
    check_attention(cache, torch.tensor([48, 64], dtype=torch.int32))
    check_selection(cache, torch.tensor([48, 64], dtype=torch.int32))


def _kept_scores(scores, selected):
    """The sorted scores of the selected pages of each row (padding as +inf)."""
    picked = torch.gather(scores, 2, selected.long().clamp(min=0))
    return picked.masked_fill(selected < 0, float("inf")).sort(-1).values


@pytest.mark.parametrize("block", [1024, pytest.param(16, marks=pytest.mark.slow)],  # both in the GPU window
                         ids=["one-chunk", "chunked"])
def test_selection_kernel_equals_finish_selection(block, monkeypatch):
    """The fused top-k selection kernel against the torch reference on random score rows: short and
    empty requests, dense and sparse budgets, the sync-free widths, rows in one chunk and in several
    (`SELECT_BLOCK` pages a chunk); with tied scores (where torch.topk's order is unspecified) the number
    kept per row and the multiset of kept scores agree."""
    from sparrow.kernels import page_scoring
    from sparrow.kernels.page_scoring import finish_selection, select_from_scores_triton

    monkeypatch.setattr(page_scoring, "SELECT_BLOCK", block)

    g = torch.Generator().manual_seed(5)
    for trial in range(12):
        b, hkv, mp = 1 + trial % 4, 1 + trial % 3, int(torch.randint(1, 90, (1,), generator=g))
        seq = torch.randint(0, mp * 16 + 1, (b,), generator=g, dtype=torch.int32)
        scores = torch.randn(b, hkv, mp, generator=g)
        ties = trial % 3 == 0
        if ties:
            scores = scores.round()
        last = ((seq.long() - 1) // 16)[:, None, None]
        page = torch.arange(mp)
        scores = scores.masked_fill(~((page >= 1) & (page <= last - 2)), float("-inf"))
        budgets = torch.randint(0, 8, (b,), generator=g, dtype=torch.int32) * 16
        budgets[budgets > 0] += 48
        scores, seq, budgets = scores.to(DEVICE), seq.to(DEVICE), budgets.to(DEVICE)
        need = finish_selection(scores, seq, budgets).shape[-1]
        for width in (None, need, mp + 5):
            want = finish_selection(scores, seq, budgets, max_selected=width)
            got = select_from_scores_triton(scores, seq, budgets, max_selected=width)
            assert got.shape == want.shape
            if not ties:
                assert torch.equal(got, want), (trial, width)
                continue
            assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
            assert torch.equal(_kept_scores(scores, got), _kept_scores(scores, want))


def test_counting_select_candidate_keeps_the_radix_selects_pages():
    """bench/select_candidates.py's counting select (timed beside the radix select by bench/kernel_times.py
    --part select-sweep) keeps exactly the radix select's pages: ties (lowest page first), rows from empty
    to a few hundred pages, dense budgets and budgets that keep no candidate, 2- and 4-bit digits."""
    from sparrow.kernels.page_scoring import select_from_scores_triton

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from select_candidates import select_count_triton

    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        b, hkv, mp = 1 + trial % 3, 1 + trial % 2, int(torch.randint(1, 300, (1,), generator=g))
        seq = torch.randint(0, mp * 16 + 1, (b,), generator=g, dtype=torch.int32)
        scores = torch.randn(b, hkv, mp, generator=g)
        if trial % 3 == 0:
            scores = (2 * scores).round()
        last = ((seq.long() - 1) // 16)[:, None, None]
        page = torch.arange(mp)
        scores = scores.masked_fill(~((page >= 1) & (page <= last - 2)), float("-inf"))
        budgets = torch.randint(0, 12, (b,), generator=g, dtype=torch.int32) * 16
        budgets[budgets > 0] += 48
        budgets[0] = 48 if trial % 4 == 0 else budgets[0]  # keeps the reserved pages only
        scores, seq, budgets = scores.to(DEVICE), seq.to(DEVICE), budgets.to(DEVICE)
        width = mp + 3
        want = select_from_scores_triton(scores, seq, budgets, max_selected=width)
        got = select_count_triton(scores, seq, budgets, 16, width, digit_bits=2 + 2 * (trial % 2),
                                  num_warps=4)
        assert torch.equal(got, want), trial


def test_empty_request_rows_give_zeros():
    """A batch slot with seq_len 0 (no pages) yields zeros, not NaN, in both implementations."""
    cache = Cache([40, 20], hq=2, hkv=2, d=16, seed=14, device=DEVICE)
    seq_lens = cache.seq_lens.clone()
    seq_lens[1] = 0
    table = cache.block_table.clone()
    table[1] = -1
    for kernels in (ops.TORCH, ops.TRITON):
        budgets = torch.tensor([48, 48], device=DEVICE)
        sel = kernels.select_pages(cache.q, cache.centroids, table, seq_lens, budgets)
        assert bool((sel[1] == -1).all())
        sparse = kernels.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, table, seq_lens, sel)
        dense = kernels.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, table, seq_lens)
        for out in (sparse, dense):
            assert torch.isfinite(out).all() and bool((out[1] == 0).all())


def test_race_kernel_draws_what_the_float64_reference_draws():
    """The sampler's race kernel (kernels/race_sample.py) against the float64 numpy race over the same
    splitmix64 bits, on random rows: as given row seeds, keyed by (seed, position), with the vocabulary in
    one slice and in several; the C++ race (a CPU's) draws the same tokens from the same rows and seeds;
    and a token whose noise is the top cell (U rounds to 1 in fp32) does not beat one holding all the mass."""
    from test_sampler import _top_cell_cases

    from sparrow.kernels import cpu_sampling
    from sparrow.kernels.race_sample import race_sample_triton, row_seeds

    logp = torch.log_softmax(torch.randn(64, 3001, generator=torch.Generator().manual_seed(6)) * 3, -1)
    seeds = torch.randint(-2**62, 2**62, (64,), generator=torch.Generator().manual_seed(7))
    positions = torch.randint(0, 1 << 16, (64,), generator=torch.Generator().manual_seed(8))
    want = cpu_sampling.race_sample_reference(logp, seeds)
    keyed = cpu_sampling.race_sample_reference(logp, row_seeds(seeds, positions))
    dev = logp.to(DEVICE)
    for splits in (1, 3):
        got = race_sample_triton(dev, seeds.to(DEVICE), splits=splits, block=512)
        assert torch.equal(got.cpu(), want), splits
        got = race_sample_triton(dev, seeds.to(DEVICE), positions.to(DEVICE), splits=splits, block=512)
        assert torch.equal(got.cpu(), keyed), splits
    if cpu_sampling.usable(logp):
        assert torch.equal(cpu_sampling.race_sample(logp, seeds), want)
    cases = _top_cell_cases()
    peaked = torch.full((len(cases), 4096), -40.0)
    peaked[:, 7] = 0.0
    peaked = torch.log_softmax(peaked, -1).to(DEVICE)
    top = torch.tensor([seed for seed, _ in cases], device=DEVICE)
    assert race_sample_triton(peaked, top).tolist() == [7] * len(cases)


@pytest.mark.slow
def test_race_kernel_frequencies_match_the_distribution():
    """The race kernel's draws, each keyed by its own (seed, position), against the softmax they must
    draw from, untruncated and with top-k's -inf tokens (fewer draws under the interpreter: looser bound)."""
    from test_sampler import _expected

    from sparrow.kernels.race_sample import race_sample_triton

    draws, rows, bound = (20000, 2000, 0.015) if DEVICE == "cuda" else (6000, 2000, 0.03)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    for temperature, top_k in ((1.0, 0), (0.7, 5)):
        want = _expected(logits, temperature, top_k)
        logp = torch.log_softmax(logits / temperature, -1)
        if top_k:
            logp = logp.masked_fill(torch.from_numpy(want == 0)[None], float("-inf"))
        batch = logp.expand(rows, -1).contiguous().to(DEVICE)
        counts = np.zeros(12)
        for j in range(draws // rows):
            positions = torch.full((rows,), j, device=DEVICE)
            tokens = race_sample_triton(batch, torch.arange(rows, device=DEVICE), positions)
            np.add.at(counts, tokens.cpu().numpy(), 1)
        freq = counts / counts.sum()
        assert np.abs(freq - want).max() < bound, (temperature, top_k, freq, want)
        assert freq[want == 0].sum() == 0


# The new kernels round to bf16 through `round_to` (to nearest even under the interpreter too), so in bf16
# they match the eager chain bit for bit except where a sum's order or rsqrt's last bit moves a rounding.


def _ulp_close(got, want, dtype):
    """Equal in fp32 up to a sum's order; in bf16 at most one rounding step apart (rounding points are
    the reference's, but a sum's order or rsqrt's last bit can move one)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,h", [(3, 100), (5, 640)])
def test_add_rms_norm_triton(n, h, dtype):
    """Residual add + RMSNorm against the eager module's chain: residual bit-identical, normed rows equal
    up to the sum's order; with no x (the first layer) the residual is left as it was."""
    from sparrow.kernels.add_rms_norm import add_rms_norm_reference, add_rms_norm_triton

    g = torch.Generator().manual_seed(n + h)
    x = (3 * torch.randn(n, h, generator=g)).to(dtype).to(DEVICE)
    residual = torch.randn(n, h, generator=g).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEVICE)
    for delta in (x, None):
        r_got, r_want = residual.clone(), residual.clone()
        got = add_rms_norm_triton(delta, r_got, weight, 1e-6)
        want = add_rms_norm_reference(delta, r_want, weight, 1e-6)
        assert got.dtype == dtype
        assert torch.equal(r_got, r_want)
        if delta is None:
            assert torch.equal(r_got, residual)
        _ulp_close(got, want, dtype)
    out = torch.empty_like(residual)  # into a given buffer (the static step's)
    assert add_rms_norm_triton(None, residual.clone(), weight, 1e-5, out=out) is out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,i", [(4, 37), (2, 1500)])
def test_silu_mul_triton(n, i, dtype):
    from sparrow.kernels.silu_mul import silu_mul_reference, silu_mul_triton

    gate_up = (4 * torch.randn(n, 2 * i, generator=torch.Generator().manual_seed(i))).to(dtype).to(DEVICE)
    got = silu_mul_triton(gate_up)
    assert got.shape == (n, i) and got.dtype == dtype
    _ulp_close(got, silu_mul_reference(gate_up), dtype)


def _rope_tables(positions: int, d: int, theta: float = 1000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    emb = torch.outer(torch.arange(positions).float(), inv).repeat(1, 2)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype,cdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16", "bf16-centroids"])
@pytest.mark.parametrize("hq,hkv,d,norm", [(6, 2, 64, True), (4, 4, 80, False), (8, 1, 32, True)])
def test_qk_norm_rope_append_triton(hq, hkv, d, norm, dtype, cdtype):
    """The fused q/k norm + rotation + KV append against the eager chain (norm modules, apply_rope,
    append_kv's reference): queries, the written K/V slots and the centroids (offset 0 sets them, later
    offsets update the running mean); padding rows (slot -1) write nothing; GQA groups of 3 and a head
    dim whose half is not a power of two."""
    from sparrow.kernels.qk_norm_rope_append import qk_norm_rope_append_reference, qk_norm_rope_append_triton

    g = torch.Generator().manual_seed(hq * d)
    n, pages, page = 5, 6, 16
    qkv = (2 * torch.randn(n, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEVICE)
    positions = torch.tensor([0, 17, 300, 5, 40], device=DEVICE)
    slots = torch.tensor([2 * page, 4 * page + 1, -1, 1 * page + 5, 5 * page + 15], device=DEVICE)
    cos, sin = _rope_tables(512, d)
    qw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    kw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    k_pages = torch.randn(pages, hkv, page, d, generator=g).to(dtype).to(DEVICE)
    v_pages = torch.randn(pages, hkv, page, d, generator=g).to(dtype).to(DEVICE)
    cents = torch.randn(pages, hkv, d, generator=g).to(cdtype).to(DEVICE)
    got_kv = [t.clone() for t in (k_pages, v_pages, cents)]
    want_kv = [t.clone() for t in (k_pages, v_pages, cents)]
    q_got = qk_norm_rope_append_triton(qkv, positions, slots, cos, sin, qw, kw, 1e-6, *got_kv, hq)
    q_want = qk_norm_rope_append_reference(qkv, positions, slots, cos, sin, qw, kw, 1e-6, *want_kv, hq)
    assert q_got.shape == (n, hq, d) and q_got.dtype == dtype
    _ulp_close(q_got, q_want, dtype)
    for got, want, before in zip(got_kv, want_kv, (k_pages, v_pages, cents)):
        _ulp_close(got, want, got.dtype)
        assert torch.equal(got[3], before[3])  # page 3: only the padding row pointed near it: untouched
    assert torch.equal(got_kv[1], want_kv[1])  # values are copied, never rounded differently


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_append_kv_bf16_centroids_hold_each_full_pages_mean(dtype):
    """bf16 centroids: 40 tokens appended one at a time into 3 pages (two completed, one partial): each
    completed page's centroid is its keys' mean rounded to bf16 once (from the definition, float64),
    in the reference and in the kernel; the partial page holds the running mean."""
    g = torch.Generator().manual_seed(2)
    hkv, d, pages = 2, 64, 4
    keys = torch.randn(40, hkv, d, generator=g).to(dtype)
    order = [3, 0, 2]  # logical page -> physical page
    for kernels in (ops.TORCH, ops.TRITON):
        k_pages = torch.full((pages, hkv, P, d), float("nan"), dtype=dtype, device=DEVICE)
        v_pages = torch.zeros_like(k_pages)
        cents = torch.zeros(pages, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        for t in range(40):
            slot = torch.tensor([order[t // P] * P + t % P], device=DEVICE)
            kv = keys[t:t + 1].to(DEVICE)
            kernels.append_kv(k_pages, v_pages, cents, kv, kv, slot)
        for logical in (0, 1):
            want = keys[logical * P:(logical + 1) * P].double().mean(0).to(torch.bfloat16)
            got = cents[order[logical]].cpu()
            assert (got.float() - want.float()).abs().max() <= 2 ** -8 * want.float().abs().max(), kernels
        partial = keys[2 * P:].double().mean(0)
        torch.testing.assert_close(cents[order[2]].cpu().double(), partial, atol=3e-2, rtol=3e-2)


def _brute_select(scores, seq_lens, budgets, page=16):
    """From the definition: pages 0, last-1, last and the best budget/P - 3 of the candidates 1..last-2,
    ties to the lower page; sorted lists per (row, head)."""
    out = []
    for b in range(scores.shape[0]):
        n_pages = -(-int(seq_lens[b]) // page)
        last = n_pages - 1
        budget = int(budgets[b])
        n_sel = max(budget // page - 3, 0) if budget > 0 else scores.shape[2]
        rows = []
        for h in range(scores.shape[1]):
            cands = [p for p in range(1, last - 1) if float(scores[b, h, p]) > float("-inf")]
            best = sorted(cands, key=lambda p: (-float(scores[b, h, p]), p))[:n_sel]
            reserved = [p for p in (0, last - 1, last) if 0 <= p < n_pages]
            rows.append(sorted(set(best) | set(reserved)))
        out.append(rows)
    return out


def test_selection_kernel_ties_and_reads_only_the_rows_pages():
    """The radix top-k against a brute force of the rule with heavy ties (scores from a few values: the
    lowest pages win among equal scores), rows from empty to 1,500 pages in tables up to 1,600 wide
    (chunks of the row), dense and sparse budgets; the scores past each row's candidates hold NaN,
    which must change nothing (the kernel reads no further than the row's pages)."""
    from sparrow.kernels.page_scoring import select_from_scores_triton

    g = torch.Generator().manual_seed(9)
    for trial, (mp, values) in enumerate(((40, 3), (300, 5), (1600, 4), (1600, 0), (70, 0))):
        b, hkv = 4, 2
        seq = torch.tensor([0, 16 * mp, 37, 16 * (mp - 100) + 3 if mp > 100 else 16 * mp - 20],
                           dtype=torch.int32)
        scores = torch.randn(b, hkv, mp, generator=g)
        if values:
            scores = torch.randint(0, values, (b, hkv, mp), generator=g).float() - 1.5
        last = ((seq.long() - 1) // 16)[:, None, None]
        page = torch.arange(mp)
        scores = scores.masked_fill(~((page >= 1) & (page <= last - 2)), float("-inf"))
        scores = scores.masked_fill(page > last - 2, float("nan"))  # never written in the fused path
        for budgets in ([48, 64, 512, 96], [0, 2048, 80, 0], [64, 0, 48, 1024]):
            budgets = torch.tensor(budgets, dtype=torch.int32)
            want = _brute_select(scores, seq, budgets)
            width = max(len(r) for rows in want for r in rows)
            for max_selected in (None, width + 3):
                got = select_from_scores_triton(scores.to(DEVICE), seq.to(DEVICE), budgets.to(DEVICE),
                                                max_selected=max_selected).cpu()
                assert got.shape[-1] == (width if max_selected is None else max_selected)
                lists = [[[int(p) for p in got[i, h] if p >= 0] for h in range(hkv)] for i in range(b)]
                assert lists == want, (trial, budgets)
                assert bool((got[..., :][got < 0] == -1).all())


def test_split_kv_per_row_length_in_a_wide_table():
    """A table much wider than most rows (as a CUDA graph's, captured for the longest sequence), rows
    from 1 token to the full width, split 1 to 16 ways: each row's range is divided by its own length,
    equal to the references."""
    cache = Cache([1, 16, 900, 33], hq=4, hkv=2, d=32, seed=31)
    wide = torch.full((4, 120), -1, dtype=torch.int32)
    wide[:, : cache.block_table.shape[1]] = cache.block_table
    cache.block_table = wide
    cache.to(DEVICE)
    budgets = torch.tensor([48, 0, 160, 64], dtype=torch.int32, device=DEVICE)
    sel = ops.TORCH.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                           max_selected=120)
    want_s = ops.TORCH.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                        cache.seq_lens, sel)
    want_d = ops.TORCH.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                       cache.seq_lens)
    for splits in (1, 3, 16):
        got_s = paged_decode_triton(cache.q, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens,
                                    sel, num_splits=splits)
        got_d = paged_decode_triton(cache.q, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens,
                                    None, num_splits=splits)
        torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_d, want_d, atol=1e-4, rtol=1e-4)
    sel_t = ops.TRITON.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                                    max_selected=120)
    assert torch.equal(sel_t, sel)


@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_page_scores_with_bf16_or_fp32_centroids(cdtype):
    """The scoring kernel reads fp32 or bf16 centroids (scores in fp32 either way), and without `fill`
    writes the candidates' scores only."""
    from sparrow.kernels.page_scoring import page_scores_triton

    cache = Cache([5, 300, 100], hq=6, hkv=2, d=64, seed=17)
    cache.centroids = cache.centroids.to(cdtype)
    cache.to(DEVICE)
    want = ops.TORCH.page_scores(cache.q, cache.centroids, cache.block_table, cache.seq_lens)
    full = page_scores_triton(cache.q, cache.centroids, cache.block_table, cache.seq_lens)
    assert torch.equal(torch.isinf(full), torch.isinf(want))
    part = page_scores_triton(cache.q, cache.centroids, cache.block_table, cache.seq_lens, fill=False)
    finite = torch.isfinite(want)
    torch.testing.assert_close(full[finite], want[finite], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(part[finite], want[finite], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# slow: the sweep
# ----------------------------------------------------------------------------------------------------

GQA = [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)]  # ratios 1, 2, 3, 4, 8


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_decode_triton_sweep(hq, hkv, d, dtype):
    cache = Cache([5, 300, 16, 130, 200], hq, hkv, d, shared=(1, 3, 4), seed=hq * 10 + hkv + d, dtype=dtype)
    budgets = torch.tensor([48, 64, 0, 48, 1024], dtype=torch.int32)  # 1024 > length: dense fallback
    check_attention(cache, budgets, splits=(None, 1, 64) if dtype == torch.float32 else (None,))


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_page_scoring_triton_sweep(hq, hkv, d):
    cache = Cache([5, 300, 16, 130, 200, 47], hq, hkv, d, shared=(1, 3, 4), seed=hq + hkv + d)
    budgets = torch.tensor([48, 64, 0, 48, 1024, 64], dtype=torch.int32)
    check_selection(cache, budgets)
    check_selection(cache, budgets, max_selected=cache.block_table.shape[1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 128), (8, 1, 64)])
def test_append_kv_triton_sweep(hq, hkv, d, dtype):
    check_append([5, 300, 16, 47], hq, hkv, d, dtype, shared=(1, 3, 2), appended=17)


@pytest.mark.slow
@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_decode_triton_block_sizes_and_wide_selection(block_n):
    cache = Cache([5, 300, 77], hq=6, hkv=2, d=64, seed=21, device=DEVICE)
    budgets = torch.tensor([48, 64, 0], dtype=torch.int32, device=DEVICE)
    sel = ops.TORCH.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                           max_selected=cache.block_table.shape[1])  # lots of -1 padding
    want = ops.TORCH.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                      cache.seq_lens, sel)
    for ns in (1, 2, 5):
        got = paged_decode_triton(cache.q, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens,
                                  sel, num_splits=ns, block_n=block_n)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # budget 0 selects every page: sparse over that selection equals dense
    dense_sel = ops.TORCH.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens,
                                 torch.zeros(3, dtype=torch.int32, device=DEVICE))
    args = (cache.q, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens)
    a = paged_decode_triton(*args, dense_sel, block_n=block_n)
    b = paged_decode_triton(*args, None, block_n=block_n)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_append_kv_triton_direct_noncontiguous_inputs():
    """k/v handed over as views (e.g. slices of a fused qkv projection) are accepted."""
    k_pages = torch.zeros(4, 2, 16, 64, device=DEVICE)
    v_pages = torch.zeros(4, 2, 16, 64, device=DEVICE)
    cents = torch.zeros(4, 2, 64, device=DEVICE)
    kv = torch.randn(3, 2, 2, 64, device=DEVICE)
    slots = torch.tensor([16 * 2 + 0, 16 * 0 + 5, -1], device=DEVICE)
    ref = [t.clone() for t in (k_pages, v_pages, cents)]
    append_kv_triton(k_pages, v_pages, cents, kv[:, 0], kv[:, 1], slots)
    ops.TORCH.append_kv(*ref, kv[:, 0], kv[:, 1], slots)
    for a, b in zip((k_pages, v_pages, cents), ref):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter works in this process")
def test_in_fresh_process(request):
    """Fallback when triton was imported before TRITON_INTERPRET=1: rerun this module in a new process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    marker = request.config.getoption("-m") or "not slow"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
                           __file__], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


AOT_SCRIPT = """
import inspect, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparrow.kernels import (add_rms_norm, append_kv, page_scoring, qk_norm_rope_append, race_sample,
                             silu_mul, sparse_decode, sparse_prefill)

def build(lazy, types, consts, arch, num_warps=4):
    fn = lazy.jit()
    names = inspect.signature(lazy.fn).parameters
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                   options=dict(num_warps=num_warps, num_stages=2))

for arch in (80, 90):
    for dt in ("bf16", "fp32"):
        for cd in ("fp32", "bf16"):  # the centroids' dtype
            for d, g in ((64, 3), (128, 4)):
                build(append_kv._append_kv_jit, dict(k_pages="*" + dt, v_pages="*" + dt, centroids="*" + cd,
                      k="*" + dt, v="*" + dt, slots="*i64"),
                      dict(D=d, BLOCK_D=d, PAGE=16, MEAN_AT_END=cd != "fp32"), arch, 1)
                build(page_scoring._page_scores_jit, dict(q="*" + dt, centroids="*" + cd, block_table="*i32",
                      seq_lens="*i32", scores="*fp32"),
                      dict(D=d, BLOCK_D=d, G=g, BLOCK_G=triton.next_power_of_2(g), PAGE=16, BLOCK_P=64,
                           FILL=cd == "fp32"), arch)
                for norm in (True, False):
                    build(qk_norm_rope_append._qk_norm_rope_append_jit, dict(
                          qkv="*" + dt, positions="*i64", slots="*i64", cos="*fp32", sin="*fp32",
                          q_weight="*" + dt, k_weight="*" + dt, q_out="*" + dt, k_pages="*" + dt,
                          v_pages="*" + dt, centroids="*" + cd, eps="fp32"),
                          dict(D=d, HALF=d // 2, BLOCK_H=d // 2, G=g, BLOCK_G=triton.next_power_of_2(g),
                               HQ=8 * g, HKV=8, PAGE=16, QK_NORM=norm, MEAN_AT_END=cd != "fp32"), arch,
                          1 if g * d <= 1024 else 2)
        for d, g in ((64, 3), (128, 8)):
            for dense, qt in ((False, 1), (True, 1), (True, 5)):  # qt: a verification's grouped queries
                build(sparse_decode._paged_decode_jit, dict(q="*" + dt, k_pages="*" + dt, v_pages="*" + dt,
                      block_table="*i32", seq_lens="*i32", selected="*i32", groups="*i32", ws_m="*fp32",
                      ws_l="*fp32", ws_acc="*fp32", scale_log2="fp32"),
                      dict(D=d, BLOCK_D=d, G=g, BLOCK_G=max(16, triton.next_power_of_2(g * qt)), PAGE=16,
                           BLOCK_N=64, DENSE=dense, PRECISION="ieee", UPCAST=False, QT=qt), arch)
            build(sparse_decode._merge_splits_jit, dict(ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32",
                  out="*" + dt), dict(D=d, BLOCK_D=d, BLOCK_S=32), arch, 2)
            for rows, warps in ((128, 8), (64, 4)):
                build(sparse_prefill._sparse_prefill_jit, dict(q="*" + dt, keys="*" + dt, values="*" + dt,
                      positions="*i32", kept="*u8", blocks="*u8", out="*" + dt, scale_log2="fp32"),
                      dict(D=d, BLOCK_D=d, G=g, TILE=rows // g, BLOCK_R=rows, PAGE=16, BLOCK_N=64,
                           PRECISION="ieee", UPCAST=False), arch, warps)
        for h, warps in ((2560, 8), (1000, 4)):
            for has_x in (True, False):
                build(add_rms_norm._add_rms_norm_jit, dict(x="*" + dt, residual="*" + dt, weight="*" + dt,
                      out="*" + dt, eps="fp32"), dict(BLOCK=triton.next_power_of_2(h), HAS_X=has_x), arch,
                      warps)
        build(silu_mul._silu_mul_jit, dict(gate_up="*" + dt, out="*" + dt), dict(BLOCK=1024), arch)
    for block_p, block_w in ((1024, 128), (64, 16)):
        build(page_scoring._select_jit, dict(scores="*fp32", seq_lens="*i32", budgets="*i32",
              selected="*i32", counts="*i32"),
              dict(PAGE=16, RESERVED=3, BLOCK_P=block_p, BLOCK_W=block_w), arch)
    for keyed in (False, True):
        build(race_sample._race_jit, dict(logp="*fp32", seeds="*i64", positions="*i64", best_score="*fp32",
              best_index="*i32"), dict(KEYED=keyed, BLOCK=1024), arch)
print("compiled")
"""


# Other triton installs to compile with too, e.g. the GPU image's version installed to a side folder
# (`uv pip install --target /tmp/triton36 --no-deps triton==3.6.0`; SPARROW_AOT_TRITON=/tmp/triton36).
OTHER_TRITONS = [p for p in os.environ.get("SPARROW_AOT_TRITON", "").split(os.pathsep) if p]


@pytest.mark.slow
@pytest.mark.parametrize("triton_path", [None, *OTHER_TRITONS])
def test_kernels_compile_for_sm80_and_sm90(triton_path, tmp_path):
    """Ahead-of-time compile (Triton -> PTX -> ptxas cubin) of every kernel for A100 and H100, no GPU
    needed: catches what the interpreter accepts but the compiler does not (dot shapes, types); with
    the venv's triton and each of SPARROW_AOT_TRITON's."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if triton_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([triton_path, *filter(None, [env.get("PYTHONPATH")])])
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
