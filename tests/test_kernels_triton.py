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

from test_kernels import Cache  # noqa: E402  (tests/ is on sys.path: rootdir-relative test imports)

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
    sel = ops.select_pages(q32, cache.centroids, cache.block_table, cache.seq_lens, budgets, impl="torch")
    want_sparse = ops.sparse_paged_attention(q32, k32, v32, cache.block_table, cache.seq_lens, sel, scale,
                                             impl="torch")
    want_dense = ops.dense_paged_attention(q32, k32, v32, cache.block_table, cache.seq_lens, scale,
                                           impl="torch")
    for ns in splits:
        got = ops.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                         cache.seq_lens, sel, scale, impl="triton", num_splits=ns)
        assert got.dtype == dtype and got.shape == cache.q.shape
        torch.testing.assert_close(got.float(), want_sparse, **tol(dtype))
        got = ops.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                        cache.seq_lens, scale, impl="triton", num_splits=ns)
        torch.testing.assert_close(got.float(), want_dense, **tol(dtype))


def check_selection(cache: Cache, budgets, max_selected=None):
    cache.to(DEVICE)
    budgets = budgets.to(DEVICE)
    q = cache.q
    scores_t = ops.page_scores(q, cache.centroids, cache.block_table, cache.seq_lens, impl="triton")
    scores_r = ops.page_scores(q, cache.centroids, cache.block_table, cache.seq_lens, impl="torch")
    assert torch.equal(torch.isinf(scores_t), torch.isinf(scores_r))
    finite = torch.isfinite(scores_r)
    torch.testing.assert_close(scores_t[finite], scores_r[finite], atol=1e-4, rtol=1e-4)
    sel_t = ops.select_pages(q, cache.centroids, cache.block_table, cache.seq_lens, budgets, impl="triton",
                             max_selected=max_selected)
    sel_r = ops.select_pages(q, cache.centroids, cache.block_table, cache.seq_lens, budgets, impl="torch",
                             max_selected=max_selected)
    assert torch.equal(sel_t, sel_r)


def check_append(lengths, hq, hkv, d, dtype, shared=None, appended=5):
    got = Cache(lengths, hq, hkv, d, shared=shared, appended=appended, dtype=dtype, impl="triton",
                device=DEVICE)
    want = Cache(lengths, hq, hkv, d, shared=shared, appended=appended, dtype=dtype, impl="torch",
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


def test_decode_triton_bf16_fast():
    cache = Cache([37, 130], hq=4, hkv=1, d=128, seed=13, dtype=torch.bfloat16)
    check_attention(cache, torch.tensor([48, 64], dtype=torch.int32))
    check_selection(cache, torch.tensor([48, 64], dtype=torch.int32))


def _kept_scores(scores, selected):
    """The sorted scores of the selected pages of each row (padding as +inf)."""
    picked = torch.gather(scores, 2, selected.long().clamp(min=0))
    return picked.masked_fill(selected < 0, float("inf")).sort(-1).values


def test_selection_kernel_equals_finish_selection():
    """The fused top-k selection kernel against the torch reference on random score rows: short and
    empty requests, dense and sparse budgets, the sync-free widths; with tied scores (where torch.topk's
    order is unspecified) the number kept per row and the multiset of kept scores agree."""
    from sparrow.kernels.page_scoring import finish_selection, select_from_scores_triton

    g = torch.Generator().manual_seed(5)
    for trial in range(24):
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


def test_empty_request_rows_give_zeros():
    """A batch slot with seq_len 0 (no pages) yields zeros, not NaN, in both implementations."""
    cache = Cache([40, 20], hq=2, hkv=2, d=16, seed=14, device=DEVICE)
    seq_lens = cache.seq_lens.clone()
    seq_lens[1] = 0
    table = cache.block_table.clone()
    table[1] = -1
    for impl in ("torch", "triton"):
        budgets = torch.tensor([48, 48], device=DEVICE)
        sel = ops.select_pages(cache.q, cache.centroids, table, seq_lens, budgets, impl=impl)
        assert bool((sel[1] == -1).all())
        sparse = ops.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, table, seq_lens, sel,
                                            impl=impl)
        dense = ops.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, table, seq_lens, impl=impl)
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
    sel = ops.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                           max_selected=cache.block_table.shape[1], impl="torch")  # lots of -1 padding
    want = ops.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                      cache.seq_lens, sel, impl="torch")
    for ns in (1, 2, 5):
        got = paged_decode_triton(cache.q, cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens,
                                  sel, num_splits=ns, block_n=block_n)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # budget 0 selects every page: sparse over that selection equals dense
    dense_sel = ops.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens,
                                 torch.zeros(3, dtype=torch.int32, device=DEVICE), impl="torch")
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
    ops.append_kv(*ref, kv[:, 0], kv[:, 1], slots, impl="torch")
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
from sparrow.kernels import append_kv, page_scoring, race_sample, sparse_decode

def build(lazy, types, consts, arch, num_warps=4):
    lazy.fn.__globals__["tl"] = tl
    fn = triton.jit(lazy.fn)
    names = inspect.signature(lazy.fn).parameters
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                   options=dict(num_warps=num_warps, num_stages=2))

for arch in (80, 90):
    for dt in ("bf16", "fp32"):
        for d, g in ((64, 3), (128, 8)):
            build(append_kv._append_kv_jit, dict(k_pages="*" + dt, v_pages="*" + dt, centroids="*fp32",
                  k="*" + dt, v="*" + dt, slots="*i64"), dict(D=d, BLOCK_D=d, PAGE=16), arch, 1)
            build(page_scoring._page_scores_jit, dict(q="*" + dt, centroids="*fp32", block_table="*i32",
                  seq_lens="*i32", scores="*fp32"),
                  dict(D=d, BLOCK_D=d, G=g, BLOCK_G=triton.next_power_of_2(g), PAGE=16, BLOCK_P=64), arch)
            for dense in (False, True):
                build(sparse_decode._paged_decode_jit, dict(q="*" + dt, k_pages="*" + dt, v_pages="*" + dt,
                      block_table="*i32", seq_lens="*i32", selected="*i32", ws_m="*fp32", ws_l="*fp32",
                      ws_acc="*fp32", scale_log2="fp32"),
                      dict(D=d, BLOCK_D=d, G=g, BLOCK_G=16, PAGE=16, BLOCK_N=64, DENSE=dense,
                           PRECISION="ieee", UPCAST=False), arch)
            build(page_scoring._select_jit, dict(scores="*fp32", seq_lens="*i32", budgets="*i32",
                  selected="*i32", counts="*i32"),
                  dict(PAGE=16, RESERVED=3, BLOCK_P=2048 if d == 128 else 64, BLOCK_W=128), arch)
            build(sparse_decode._merge_splits_jit, dict(ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32",
                  out="*" + dt), dict(D=d, BLOCK_D=d, BLOCK_S=32), arch, 2)
    for keyed in (False, True):
        build(race_sample._race_jit, dict(logp="*fp32", seeds="*i64", positions="*i64", best_score="*fp32",
              best_index="*i32"), dict(KEYED=keyed, BLOCK=1024), arch)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm80_and_sm90():
    """Ahead-of-time compile (Triton -> PTX -> ptxas cubin) of every kernel for A100 and H100, no GPU
    needed: catches what the interpreter accepts but the compiler does not (dot shapes, types)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
