"""The C++ CPU kernels (AVX512-BF16, or AVX2 and FMA) against float64 attention and the torch references,
the packed layouts against their definition, and the engine using them (kernels/cpu_attention.py)."""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels import cpu_attention as kernel
from sparrow.kernels.cascade_decode import CascadeRows, prefix_attention
from sparrow.kernels.page_scoring import mask_candidates
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model.loading import load_model

needs_kernel = pytest.mark.skipif(not kernel.available(), reason="no AVX2 or no C++ toolchain")


def test_the_kernels_build_where_the_cpu_runs_them():
    """A CPU with AVX512-BF16, or AVX2 and FMA, and a C++ compiler must build the kernels: a source that
    fails to compile would otherwise turn every kernel test here into a skip and every engine into the
    torch paths."""
    import shutil

    flags = kernel.cpu_flags()
    if kernel.isa() is None or shutil.which("c++") is None:
        assert not {"avx2", "fma", "f16c"} <= flags or shutil.which("c++") is None
        pytest.skip("no AVX2 or no C++ compiler: the torch paths are the ones that run")
    want = kernel.Isa.AVX512_BF16 if "avx512_bf16" in flags and "avx512bw" in flags else kernel.Isa.AVX2
    assert kernel.isa() is want
    assert kernel.available()


def test_packed_layouts_hold_what_their_definition_says():
    k = torch.randn(2, 48, 64).bfloat16()
    kp, vp = kernel.pack_keys(k).contiguous(), kernel.pack_values(k).contiguous()
    assert kp.shape == kernel.packed_key_shape(2, 48, 64) and vp.shape == kernel.packed_value_shape(2, 48, 64)
    h, key, dim = 1, 37, 21  # key 37 = block 2, lane 5; dim 21 = pair 10, second of the pair
    assert kp[h, 2, 10, 5, 1] == k[h, key, dim] and vp[h, 18, dim, 1] == k[h, key, dim]
    assert torch.equal(kernel.unpack_keys(kp), k) and torch.equal(kernel.unpack_values(vp), k)


@needs_kernel
@pytest.mark.parametrize("n,hq,hkv,d,length", [(8, 9, 3, 64, 1024), (1, 9, 3, 64, 48), (5, 9, 3, 64, 400),
                                               (2, 32, 8, 128, 272)])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
def test_kernel_equals_float64_attention(n, hq, hkv, d, length, chunks, dtype, atol):
    g = torch.Generator().manual_seed(n + d + length)
    q = (torch.randn(n, hq, d, generator=g) * 2).to(dtype)
    k, v = (torch.randn(2, hkv, length, d, generator=g) * 2).to(dtype)
    kp, vp = kernel.pack_keys(k).contiguous(), kernel.pack_values(v).contiguous()
    assert kp.shape == kernel.packed_key_shape(hkv, length, d, dtype)
    assert vp.shape == kernel.packed_value_shape(hkv, length, d, dtype)
    want_out, want_lse = kernel.prefix_attention_reference(q, kp, vp, d ** -0.5)
    out, lse = prefix_attention(q, kp, vp, d ** -0.5, chunks=chunks)  # dispatches on the packed layout
    # in bf16 the probabilities are rounded to bf16 for the value product (as the flash kernel does in bf16)
    torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0)
    flash_out, _ = prefix_attention(q, k, v, d ** -0.5, chunks=1)
    flash_error = (flash_out.double() - want_out).abs().max()
    assert (out.double() - want_out).abs().max() <= 2 * flash_error + atol / 20


@needs_kernel
def test_merge_attention_equals_attention_over_both_key_sets_row_by_row():
    """Two halves of 40 keys merged by their log-sum-exp equal float64 attention over all 80 (a row with
    no key on one side takes the other whole), and each row is what it is merged alone."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 64, generator=g) for n in (7, 80, 80))
    scores = q.double() @ k.double().T / 8

    def half(keys: slice, empty_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        s = scores[:, keys].clone()
        s[empty_rows] = float("-inf")
        lse = torch.logsumexp(s, -1)
        out = torch.nan_to_num(torch.softmax(s, -1)) @ v[keys].double()
        return out.float(), lse.float()

    (out_a, lse_a), (out_b, lse_b) = half(slice(0, 40), [5]), half(slice(40, 80), [6])
    got = kernel.merge_attention(out_a, lse_a, out_b, lse_b)
    want = torch.softmax(scores, -1) @ v.double()
    want[5] = torch.softmax(scores[5, 40:], -1) @ v[40:].double()
    want[6] = torch.softmax(scores[6, :40], -1) @ v[:40].double()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    for r in range(7):
        alone = kernel.merge_attention(out_a[r:r + 1], lse_a[r:r + 1], out_b[r:r + 1], lse_b[r:r + 1])
        assert torch.equal(alone[0], got[r])


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-5)])
@pytest.mark.parametrize("b,hq,hkv,t,d", [(1, 9, 3, 300, 64), (2, 9, 3, 77, 64), (1, 4, 2, 50, 128),
                                          (1, 3, 3, 1, 64), (3, 8, 1, 130, 64)])
def test_causal_prefill_kernel_equals_float64_attention(b, hq, hkv, t, d, dtype, atol):
    """Every position against positions <= it (right-padded rows of a batch included), q in the model's
    strides; as close to float64 as PyTorch's flash kernel is (in bf16 both round the probabilities)."""
    g = torch.Generator().manual_seed(t + d)
    q = (torch.randn(b, t, hq, d, generator=g) * 2).to(dtype).transpose(1, 2)
    k = (torch.randn(b, hkv, t, d, generator=g) * 2).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    assert kernel.causal_attention_usable(q, k)
    got = kernel.causal_attention(q, k, v, d ** -0.5)
    want = kernel.causal_attention_reference(q, k, v, d ** -0.5)
    flash = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.double() - want).abs().max() <= 2 * (flash.double() - want).abs().max() + atol / 20
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


@needs_kernel
def test_engine_prefills_through_the_kernel_as_through_flash(monkeypatch):
    """The bf16 engine's prefill attention (our kernel, the CPU backend's choice) gives the first token's
    logprobs of a prefill through PyTorch's flash kernel within bf16 rounding (prompts of two lengths, one
    padded)."""
    model = load_model("smollm2-135m", dtype=torch.bfloat16).model
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (150, 97)]
    params = SamplingParams(max_new_tokens=1, n=1, temperature=0.0, ignore_eos=True, logprobs=3)
    calls, original = [], kernel.causal_attention
    monkeypatch.setattr(kernel, "causal_attention", lambda *args: calls.append(1) or original(*args))
    ours = Engine(model, None, EngineConfig(max_batch=2)).generate(prompts, params)
    assert len(calls) == model.cfg.num_layers  # one padded prefill of both prompts
    monkeypatch.setattr(kernel, "causal_attention_usable", lambda q, k: False)
    flash = Engine(model, None, EngineConfig(max_batch=2)).generate(prompts, params)
    assert len(calls) == model.cfg.num_layers
    for a, b in zip(ours, flash):
        top_a, top_b = dict(a[0].top_logprobs[0]), dict(b[0].top_logprobs[0])
        assert len(set(top_a) & set(top_b)) >= 2
        for token in set(top_a) & set(top_b):
            assert abs(top_a[token] - top_b[token]) < 0.15  # bf16 states over 30 layers, on any thread count


@needs_kernel
def test_engine_in_bf16_stores_packed_prefixes_and_samples_as_without():
    """The same greedy tokens with the kernel as with the flash kernel, up to a near tie: bf16 logits
    of SmolLM2 (16-32) are 0.125 apart, ties are frequent, and a rounding difference upstream may pick
    another of the best tokens; past that point the samples differ. test_bf16.py holds each engine
    within 0.5 nats at a token and 0.05 on average of teacher-forced scoring (both measured 0.02-0.04
    mean here), so the two may differ by up to twice that on average."""
    model = load_model("smollm2-135m", dtype=torch.bfloat16).model
    prompt = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = []
    for packed in (True, False):
        engine = Engine(model, None, EngineConfig(max_batch=4))
        engine.runner._pack_prefixes = lambda packed=packed: packed
        engine.add_request(prompt, params)
        engine.step()
        assert engine.runner.prefixes[0].packed == packed
        done = []
        while engine.has_work():
            done += engine.step()[0]
        runs.append(sorted(done, key=lambda c: c.sample))
    gaps = []
    for a, b in zip(*runs):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:  # a near tie: within two bf16 steps of a logit of 16-32 (0.125 each) of the best
                for run, other in ((a, y), (b, x)):
                    top = dict(run.top_logprobs[i])
                    assert other in top and top[other] > max(top.values()) - 0.25, (i, run.top_logprobs[i])
                break
            gaps.append(abs(a.logprobs[i] - b.logprobs[i]))
    gaps = torch.tensor(gaps)
    assert len(gaps) >= 12 and gaps.max() < 0.5 and gaps.mean() < 0.1


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,d,page", [(3, 9, 3, 64, 16), (2, 8, 2, 128, 16), (2, 6, 3, 64, 32)])
def test_paged_attention_equals_float64_over_the_listed_positions(dtype, b, hq, hkv, d, page):
    """Listed pages in any order, -1 padding, pages past the block table's end or unmapped (-1), a
    partial last page (positions >= seq_len left out) and a row with no page at all (lse -inf, out 0).
    With bf16 pages the queries are bf16 values, as a bf16 model's are (the kernel takes them in bf16)."""
    g = torch.Generator().manual_seed(b * d + page)
    k_pages, v_pages = torch.randn(2, 40, hkv, page, d, generator=g).to(dtype)
    table = torch.randperm(40, generator=g)[: b * 10].view(b, 10).int()
    table[0, 8:] = -1
    seq_lens = torch.tensor([8 * page - 5, 10 * page, 3 * page + 1][:b]).int()
    pages = torch.randint(-1, 12, (b, hkv, 6), generator=g)
    pages[-1, 0] = -1
    q = torch.randn(b, hq, d, generator=g).to(dtype).float()
    args = (q, k_pages, v_pages, table, seq_lens, pages, d ** -0.5)
    out, lse = kernel.paged_attention(*args)
    want_out, want_lse = kernel.paged_attention_reference(*args)
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=0)
    assert torch.equal(lse.isinf(), want_lse.isinf()) and lse[-1, : hq // hkv].isinf().all()
    finite = ~want_lse.isinf()
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-6, rtol=0)


@needs_kernel
def test_ops_run_the_kernel_on_auto_and_the_torch_reference_on_torch():
    from sparrow.kernels import ops

    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(2, 12, 3, 16, 64, generator=g)
    table = torch.arange(12).view(2, 6).int()
    seq_lens = torch.tensor([90, 57]).int()
    q = torch.randn(2, 9, 64, generator=g)
    selected = torch.tensor([[0, 2, 5], [1, 3, -1]]).int()[:, None, :].expand(-1, 3, -1)
    for op, args in (("sparse_paged_attention", (selected,)), ("dense_paged_attention", ())):
        auto = getattr(ops.CPU, op)(q, k_pages, v_pages, table, seq_lens, *args)
        reference = getattr(ops.TORCH, op)(q, k_pages, v_pages, table, seq_lens, *args)
        torch.testing.assert_close(auto, reference, atol=1e-5, rtol=0)


@needs_kernel
def test_select_pages_equals_the_torch_selection_and_keeps_the_lower_page_on_a_tie():
    from sparrow.kernels.page_scoring import finish_selection

    g = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([300, 17, 1, 160, 700]).int()  # pages: 19, 2, 1, 10, 44
    budgets = torch.tensor([96, 64, 48, 0, 160]).int()  # the fourth row dense
    scores = torch.randn(5, 3, 48, generator=g)
    table = torch.arange(5 * 48).view(5, 48).int()
    table[4, 30:] = -1  # unmapped pages are never candidates
    scores = mask_candidates(scores, table, seq_lens, 16)
    want = finish_selection(scores, seq_lens, budgets)
    assert torch.equal(kernel.select_pages(scores, seq_lens, budgets, 16), want)
    assert torch.equal(kernel.select_pages(scores, seq_lens, budgets, 16, max_selected=48),
                       finish_selection(scores, seq_lens, budgets, max_selected=48))
    tied = torch.zeros(1, 1, 12)  # 12 pages, all candidates 1..9 scored equal; budget keeps 2 of them
    tied = mask_candidates(tied, torch.arange(12).view(1, 12).int(), torch.tensor([192]).int(), 16)
    picked = kernel.select_pages(tied, torch.tensor([192]).int(), torch.tensor([80]).int(), 16)
    assert picked.tolist() == [[[0, 1, 2, 10, 11]]]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_kv_writes_the_slots_and_running_means_as_the_torch_reference(dtype):
    from sparrow.kernels.append_kv import append_kv_reference

    g = torch.Generator().manual_seed(0)
    n_pages, hkv, page, d = 12, 3, 16, 64
    pages = [torch.randn(n_pages, hkv, page, d, generator=g).to(dtype) for _ in range(2)]  # garbage
    centroids = torch.randn(n_pages, hkv, d, generator=g)
    ours = [t.clone() for t in (*pages, centroids)]
    theirs = [t.clone() for t in (*pages, centroids)]
    rows = torch.tensor([5, 2, 9, 7])  # distinct pages; the third row is padding
    written = {}
    for off in range(page):  # every offset of each page in turn, as decode fills it
        slots = rows * page + off
        slots[2] = -1
        k = torch.randn(4, hkv, d, generator=g).to(dtype)
        v = torch.randn(4, hkv, d, generator=g).to(dtype)
        kernel.append_kv(*ours, k[:, :, None][:, :, 0], v, slots)  # a strided view, as the engine passes
        append_kv_reference(*theirs, k, v, slots)
        for i in (0, 1, 3):
            written.setdefault(int(rows[i]), []).append(k[i].double())
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)  # bit for bit: a preempted sequence recomputed by either gets the same means
    for p, keys in written.items():  # independent: the mean of the keys written to the page
        assert torch.allclose(ours[2][p].double(), torch.stack(keys).mean(0), atol=1e-5)
        assert torch.equal(ours[0][p, :, -1], keys[-1].to(dtype))
    pad = rows[2]  # its slot was -1 every time: nothing written
    assert torch.equal(ours[2][pad], centroids[pad]) and torch.equal(ours[0][pad], pages[0][pad])


@needs_kernel
@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 8)])
def test_score_pages_equals_float64_scores_and_the_cascade_selection_the_torch_one(dtype, d):
    """Head dim 8 (a tiny test model's) is not the kernel's: the op falls back to the torch path."""
    from sparrow.kernels import ops
    from sparrow.kernels.cascade_decode import suffix_index
    from sparrow.kernels.page_scoring import plan_selection

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, page, width = 5, 9, 3, 16, 12
    centroids = torch.randn(80, hkv, d, generator=g)
    prefixes = [torch.randn(4, hkv, d, generator=g), torch.randn(6, hkv, d, generator=g)]
    group = torch.tensor([0, 1, 0, -1, 1])  # row 3 shares no prefix
    seq_lens = torch.tensor([150, 97, 64, 190, 180]).int()  # pages 10, 7, 4, 12, 12
    table = torch.randperm(80, generator=g)[: b * width].view(b, width).int()
    table[0, 9:] = table[1, 7:] = table[2, 4:] = -1
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    q_mean = q.double().view(b, hkv, 3, d).mean(2)
    got = kernel.score_pages(q, prefixes, group, centroids, table, seq_lens, page) if d % 16 == 0 else None
    for i in range(b if got is not None else 0):
        n, m = -(-int(seq_lens[i]) // page), prefixes[group[i]].shape[0] if group[i] >= 0 else 0
        for w in range(width):
            if w >= n or (w >= m and table[i, w] < 0):
                assert (got[i, :, w] == float("-inf")).all()
                continue
            cent = prefixes[group[i]][w] if w < m else centroids[table[i, w]]
            want = (q_mean[i] * cent.double()).sum(-1)
            torch.testing.assert_close(got[i, :, w].double(), want, atol=1e-4, rtol=1e-5)
    suffix = torch.full((b, hkv, width), -1)  # the pages past each row's prefix
    for i in range(b):
        m = prefixes[group[i]].shape[0] if group[i] >= 0 else 0
        own = torch.arange(m, -(-int(seq_lens[i]) // page))
        suffix[i, :, : len(own)] = own
    pairs = [((group == j).nonzero()[:, 0], p) for j, p in enumerate(prefixes)]
    budgets = torch.tensor([96, 64, 48, 0, 80]).int()

    def plan_and_index():
        return (plan_selection(seq_lens, budgets, page, width, None, table), suffix_index(table, suffix))

    auto = ops.CPU.cascade_select_pages(q, CascadeRows(pairs, group, suffix), centroids, table, seq_lens,
                                        budgets, page)
    planned = CascadeRows(pairs, group, suffix, plan_and_index)
    reference = ops.TORCH.cascade_select_pages(q, planned, centroids, table, seq_lens, budgets, page)
    assert torch.equal(auto, reference)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)])
def test_rms_norm_and_rope_ops_equal_float64_within_one_rounding(dtype, tol):
    from sparrow.stages.engine.cpu.layers import _rope

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 1, 576, generator=g).to(dtype), (1 + torch.randn(576, generator=g)).to(dtype)
    got = torch.ops.sparrow_cpu.rms_norm(x, w, 1e-5).double()
    xd = x.double()
    want = w.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert ((got - want).abs() <= 2 * tol * want.abs() + 1e-30).all()
    q = torch.randn(8, 1, 9, 64, generator=g).to(dtype).transpose(1, 2)  # the strides the model passes
    k = torch.randn(8, 1, 3, 64, generator=g).to(dtype).transpose(1, 2)
    angle = torch.rand(8, 1, 1, 32, generator=g).double() * 100
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    for x, out in zip((q, k), _rope(q, k, cos, sin)):
        xd, c, s = x.double(), cos.double(), sin.double()
        want = xd * c + torch.cat([-xd[..., 32:], xd[..., :32]], -1) * s  # Hugging Face's rotate_half
        assert out.shape == x.shape
        torch.testing.assert_close(out.double(), want, atol=2 * tol * want.abs().max().item(), rtol=0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 16, 40])
@pytest.mark.parametrize("dtype,shape,rel,abs_", [
    (torch.float32, (10, 96, 16), 1e-5, 1e-4),  # fp32 sums of 96 products
    (torch.bfloat16, (10, 48, 16, 2), 2 ** -8, 1e-3),  # one bf16 rounding of the output
])
def test_packed_linear_equals_float64_products(rows, dtype, shape, rel, abs_):
    from sparrow.stages.engine.cpu.packed_linears import PackedLinears

    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 160).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=g))
        layer.bias.copy_(torch.randn(160, generator=g))
    packed = PackedLinears(torch.nn.Sequential(layer), batch_hint=16)
    packed.refresh()
    kind, weight = packed.packed[id(layer)]
    assert kind == "dot" and weight.shape == shape
    x = torch.randn(rows, 1, 96, generator=g).to(dtype)
    got = torch.ops.sparrow_cpu.packed_linear(x, weight, layer.bias).double()
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    assert got.shape == want.shape
    assert ((got - want).abs() <= rel * want.abs() + abs_).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_gives_each_row_what_it_gives_the_row_alone(dtype):
    """A verification's many rows through one product: every row bit for bit what a decode step's
    product of that row alone gives (greedy speculation relies on it: the same argmax)."""
    from sparrow.stages.engine.cpu.packed_linears import PackedLinears

    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(576, 320).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(320, 576, generator=g))
    packed = PackedLinears(torch.nn.Sequential(layer), batch_hint=16)
    packed.refresh()
    weight = packed.packed[id(layer)][1]
    x = torch.randn(37, 576, generator=g).to(dtype)
    many = torch.ops.sparrow_cpu.packed_linear(x, weight, layer.bias, dtype == torch.bfloat16)
    alone = torch.cat([torch.ops.sparrow_cpu.packed_linear(x[i: i + 1], weight, layer.bias,
                                                           dtype == torch.bfloat16) for i in range(37)])
    assert torch.equal(many, alone)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_packed_linear_fp32_out_is_the_unrounded_bf16_product(rows):
    """`fp32_out` (the CPU engine's lm_head on bf16 weights): bf16 inputs and weights, the products exact
    and summed in fp32, never rounded to bf16: within fp32 summation error of the float64 product."""
    from sparrow.stages.engine.cpu.packed_linears import PackedLinears, dot_product

    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(576, 320).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(320, 576, generator=g))
        layer.bias.copy_(torch.randn(320, generator=g))
    packed = PackedLinears(torch.nn.Sequential(layer), batch_hint=16)
    packed.refresh()
    weight = packed.packed[id(layer)][1]
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    for got in (dot_product(x, weight, layer.bias, fp32_out=True),
                dot_product(torch.cat([x, x[:1].expand(41 - rows, 576)]), weight, layer.bias,
                            fp32_out=True)[:rows]):  # more than 16 rows (a verification's)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    rounded = dot_product(x, weight, layer.bias)
    assert rounded.dtype == torch.bfloat16 and (rounded.double() - want).abs().max() > 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sparse_layer_as_one_op_samples_what_the_op_by_op_chain_samples(dtype, monkeypatch):
    """`sparse_decode_layer` (append, cascade scoring, selection, paged attention in one C++ op) gives the
    op-by-op chain's tokens and logprobs bit for bit, and the step takes it."""
    from sparrow.stages.engine.cpu.attention import CpuDecodeAttention

    model = load_model("smollm2-135m", dtype=dtype).model
    prompt = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_new_tokens=12, n=3, seed=4, ignore_eos=True)
    taken, one_op = [], CpuDecodeAttention._one_op
    monkeypatch.setattr(CpuDecodeAttention, "_one_op", lambda *a: taken.append(one_op(*a)) or taken[-1])
    fused = Engine(model, as_policy(96), EngineConfig(max_batch=4)).generate([prompt], params)[0]
    assert taken and all(taken)
    monkeypatch.setattr(CpuDecodeAttention, "_one_op", lambda *a: False)
    chain = Engine(model, as_policy(96), EngineConfig(max_batch=4)).generate([prompt], params)[0]
    for a, b in zip(fused, chain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
