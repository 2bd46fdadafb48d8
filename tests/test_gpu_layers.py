"""The GPU decode step's inference form (stages/engine/gpu/layers.py) against the model's modular step.

Independent references: the model's own forward (`Transformer.hidden_states` over the same
`DecodeAttention`, the step the learner's modules compute), run on a separate copy of the cache, and
teacher-forced scoring (`score_sequences`) for the engine. The fused form runs with the torch references
of its kernels (fast: isolates the stacking, the layer order and the LoRA arithmetic) and with the Triton
kernels under the interpreter (`TRITON_INTERPRET=1`, set when this module is imported on a machine
without CUDA), in fp32 and bf16, with padding rows, dense and sparse layers, Qwen3 (q/k norms) and a
Qwen2-style model (q/k/v biases, no q/k norms). The stacked parameters are checked to share memory with
the stack and to follow in-place updates, replacement, peft's injection and checkpoint writing.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers
from triton_here import DEVICE, in_fresh_process, needs_triton, rerun_in_fresh_process

from sparrow.kernels import ops
from sparrow.kernels.ops import Backend
from sparrow.stages.attention.kv_cache import PagedKVCache
from sparrow.stages.attention.paged import DecodeAttention, DecodeBatch
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import as_policy, budget_fn
from sparrow.stages.engine import DecodeStep, Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.gpu.layers import GpuDecode, base_linear, decode_hidden
from sparrow.stages.engine.static_decode import kept_pages
from sparrow.stages.model.loading import load_model, save_checkpoint
from sparrow.stages.scoring.mismatch import score_sequences

from tiny_models import tiny_qwen3

P = 16


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-gpu-layers")
    tiny_qwen3(path)
    return path


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    """A 2-layer Qwen2-style model: biases on q/k/v (jittered), no q/k norms, GQA 6/2, head dim 16."""
    cfg = transformers.Qwen2Config(vocab_size=300, hidden_size=96, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("tiny-qwen2-gpu-layers")
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _load(path, dtype=torch.float32):
    return load_model(str(path), dtype=dtype, device=DEVICE).model.eval()


def run_steps(model, decode, tokens, lengths, budgets, kernels, centroid_dtype=torch.float32,
              dense_layers=(0,),
              cache=None, first=0, until=None):
    """Decode `tokens` [B, T] one position a step from an empty paged cache, or from `cache` at step
    `first`, to step `until` (default T) (row r stops after lengths[r] tokens and is a padding row
    afterwards: slot -1, seq_len 0, no pages) -> (logits [until - first, B, V] of the active rows
    (padding rows zeroed), the cache)."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    b, t = tokens.shape
    per_row = -(-t // P)
    if cache is None:
        cache = PagedKVCache(cfg, b * per_row + 3, P, dtype, DEVICE, centroid_dtype=centroid_dtype)
    perm = torch.randperm(b * per_row + 3, generator=torch.Generator().manual_seed(3))[: b * per_row]
    table = perm.view(b, per_row).to(torch.int32).to(DEVICE)
    budgets_t = torch.tensor(budgets, dtype=torch.int32, device=DEVICE)
    out = []
    for step in range(first, t if until is None else until):
        active = torch.tensor([step < n for n in lengths], device=DEVICE)
        pos = torch.where(active, step, 0).to(DEVICE)
        slots = torch.where(active, table[:, step // P].long() * P + step % P, -1)
        seq_lens = torch.where(active, step + 1, 0).to(torch.int32)
        rows_table = torch.where(active[:, None], table, -1)
        k = kept_pages(budgets, P, per_row)
        batch = DecodeBatch(rows_table, seq_lens, budgets_t, slots, any(budgets), k or None)
        attn = DecodeAttention(cache, batch, dense_layers, cfg.head_dim ** -0.5, kernels)
        with torch.inference_mode():
            hidden = decode(tokens[:, step:step + 1].to(DEVICE), pos[:, None], attn)
            logits = model.logits(hidden).float()
        out.append(torch.where(active[:, None], logits, 0.0))
    return torch.stack(out), cache


def modular(model):
    return lambda tok, pos, attn: model.hidden_states(tok, positions=pos, attention=attn, kv_len=512)[:, 0]


def _tokens(b, t, seed=0):
    return torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def _assert_caches_equal(a: PagedKVCache, b: PagedKVCache, atol: float):
    for x, y in ((a.k, b.k), (a.v, b.v), (a.centroids, b.centroids)):
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=atol)


# ---------------------------------------------------------------------------- the weight form


def test_stacked_parameters_share_the_stack_and_follow_updates(qwen3_path, tmp_path):
    """After GpuDecode: each q/k/v (and gate/up) parameter is a row block of one storage per layer (no
    second copy), with the same values and identity; an in-place update (an optimizer step, a load)
    shows in the stacked product at once; a replaced parameter is found and stacked again by refresh;
    a checkpoint of the stacked model writes and reads back the same weights."""
    model = _load(qwen3_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    form = GpuDecode(model, ops.TORCH)
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    block = model.layers[1]
    stacked = form.qkv[1]
    for m in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
        assert m.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
    assert stacked.weight.shape == (64 + 2 * 32, 64) and form.gate_up[1].weight.shape == (2 * 96, 64)
    assert not form.refresh()  # nothing moved: a second refresh stacks nothing

    x = torch.randn(3, 64, device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[5, 6, 7]], device=DEVICE)).sum().backward()
    opt.step()
    want = torch.cat([block.attn.q_proj(x), block.attn.k_proj(x), block.attn.v_proj(x)], dim=1)
    assert not torch.equal(block.attn.q_proj.weight, before["layers.1.attn.q_proj.weight"])
    torch.testing.assert_close(form._product(stacked, x), want, atol=1e-6, rtol=1e-6)

    model.load_state_dict({k: v for k, v in before.items()}, strict=False)  # copies in place
    assert torch.equal(form.qkv[1].weight[:64], before["layers.1.attn.q_proj.weight"])

    block.mlp.up_proj.weight.data = block.mlp.up_proj.weight.data.clone() * 2  # replaced, not in place
    assert not form.gate_up[1].in_place()
    assert form.refresh() and form.gate_up[1].in_place()
    assert torch.equal(form.gate_up[1].weight[96:], 2 * before["layers.1.mlp.up_proj.weight"])

    save_checkpoint(model, None, tmp_path / "ckpt")  # safetensors refuses shared storage unless copied
    again = _load(tmp_path / "ckpt")
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("which", ["qwen3", "qwen2"])
def test_fused_layers_equal_the_modular_step_torch_ops(which, qwen3_path, qwen2_path):
    """The inference form with the kernels' torch references: every step's logits and the whole cache
    (keys, values, centroids) as the modular step's, in fp32, over 70 steps with a padding row from step
    30 on, dense layer 0 and sparse others at budget 48 (selection active from page 4 on)."""
    model = _load(qwen3_path if which == "qwen3" else qwen2_path)
    tokens = _tokens(3, 70)
    want, cache_want = run_steps(model, modular(model), tokens, [70, 30, 55], [48, 48, 0], ops.TORCH)
    form = GpuDecode(model, ops.TORCH)
    got, cache_got = run_steps(model, form.hidden, tokens, [70, 30, 55], [48, 48, 0], ops.TORCH)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _assert_caches_equal(cache_got, cache_want, 1e-5)


def _lora_model(path, adapters=("default",)):
    from peft import LoraConfig, inject_adapter_in_model

    from sparrow.stages.model.adapter import TARGET_MODULES

    model = _load(path)
    GpuDecode(model, ops.TORCH)  # stacked before peft wraps the projections (the trainer's order too)
    torch.manual_seed(4)
    for name in adapters:
        inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4.0, target_modules=list(TARGET_MODULES)), model,
                                adapter_name=name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model.eval()


def test_fused_layers_apply_active_lora_adapters(qwen3_path):
    """peft adapters on every projection (one, then two active at once as the sparse actor has them, then
    disabled): the fused step's stacked products plus each member's adapter terms equal peft's own
    forward in the modular step; the stack is still the base layers' storage."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = _lora_model(qwen3_path, adapters=("default", "sparse"))
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    tokens = _tokens(2, 40, seed=2)
    for names in (["default"], ["default", "sparse"], None):
        for m in layers:
            if names is None:
                m.enable_adapters(False)
            else:
                m.enable_adapters(True)
                m.set_adapter(names)
        want, _ = run_steps(model, modular(model), tokens, [40, 33], [48, 0], ops.TORCH)
        form = GpuDecode(model, ops.TORCH)
        assert form.usable() and not form.refresh()
        got, _ = run_steps(model, form.hidden, tokens, [40, 33], [48, 0], ops.TORCH)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        q_proj = model.layers[0].attn.q_proj
        assert base_linear(q_proj).weight.untyped_storage().data_ptr() == \
            form.qkv[0].weight.untyped_storage().data_ptr()


def test_an_adapter_kind_not_reproduced_takes_the_modular_step(qwen3_path):
    """DoRA (which the fused products do not reproduce): `usable()` is False and `decode_hidden` runs
    the model's own forward."""
    from peft import LoraConfig, inject_adapter_in_model

    model = _load(qwen3_path)
    dora = LoraConfig(r=2, lora_alpha=4.0, use_dora=True, target_modules=["q_proj", "v_proj"])
    inject_adapter_in_model(dora, model)
    form = GpuDecode(model, ops.TORCH)
    assert not form.usable()
    tokens = _tokens(2, 20, seed=3)
    want, _ = run_steps(model, modular(model), tokens, [20, 20], [0, 0], ops.TORCH)
    got, _ = run_steps(model, lambda t, p, a: decode_hidden(form, model, t, p, a, 512), tokens, [20, 20],
                       [0, 0], ops.TORCH)
    assert torch.equal(got, want)


def test_stacking_after_peft_injection_and_the_runner_restacking(qwen3_path):
    """The trainer's order (peft injects first, the engine's runner stacks the base layers after): the
    fused step applies the adapter; the GPU runner stacks at construction and, told of an update
    (`refresh_weights`, as at every run's start), stacks a replaced parameter again."""
    from sparrow.stages.engine.gpu.runner import GpuRunner
    from sparrow.stages.model.adapter import add_lora

    model = _load(qwen3_path)
    add_lora(model, rank=2, alpha=4.0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(6)  # drawn on the CPU: the same draws on every device
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    runner = GpuRunner(model, EngineConfig(max_batch=2, page_size=P, dense_layers=(0,), max_prefill_tokens=64,
                                           kernels=Backend.TORCH, decode_step=DecodeStep.PLAIN))
    form = runner.decode_form
    assert form is not None and form.usable() and form.qkv[2].in_place()
    tokens = _tokens(2, 20, seed=7)
    want, _ = run_steps(model, modular(model), tokens, [20, 20], [0, 0], ops.TORCH)
    got, _ = run_steps(model, form.hidden, tokens, [20, 20], [0, 0], ops.TORCH)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    k_proj = base_linear(model.layers[2].attn.k_proj)
    k_proj.weight.data = k_proj.weight.data.clone()
    assert not form.qkv[2].in_place()
    runner.refresh_weights()
    assert form.qkv[2].in_place()


# ---------------------------------------------------------------------------- the Triton kernels

# bf16: the fused and the modular step round at the same points, but a stacked product may sum in another
# order than three separate ones and rsqrt's last bit may differ, and one flipped bf16 rounding moves a
# logit by about 1e-2 of its size; observed on these models: under 0.05.
BF16_LOGIT_TOL = 0.1


@needs_triton
@pytest.mark.parametrize("dtype,which", [
    (torch.float32, "qwen3"),
    pytest.param(torch.bfloat16, "qwen3", marks=pytest.mark.slow),
    pytest.param(torch.float32, "qwen2", marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, "qwen2", marks=pytest.mark.slow),
], ids=["qwen3-fp32", "qwen3-bf16", "qwen2-fp32", "qwen2-bf16"])
def test_fused_triton_step_equals_the_modular_step(which, dtype, qwen3_path, qwen2_path):
    """The Triton kernels (compiled on CUDA, interpreted on a CPU): from a cache the modular step filled
    for 46 steps, 6 more steps of the fused step against the modular step with the torch references,
    logits and cache: fp32 within 1e-4, bf16 within BF16_LOGIT_TOL; a page completed at step 47, sparse
    layers selecting from step 48 (budget 48: three pages), a row past its end (padding) from step 50."""
    model = _load(qwen3_path if which == "qwen3" else qwen2_path, dtype)
    tokens = _tokens(3, 60, seed=5)
    lengths, budgets = [60, 50, 57], [48, 48, 0]
    _, start = run_steps(model, modular(model), tokens, lengths, budgets, ops.TORCH, until=46)
    cache_want, cache_got = copy.deepcopy(start), copy.deepcopy(start)
    want, _ = run_steps(model, modular(model), tokens, lengths, budgets, ops.TORCH, cache=cache_want,
                        first=46, until=52)
    form = GpuDecode(model, ops.TRITON)
    got, _ = run_steps(model, form.hidden, tokens, lengths, budgets, ops.TRITON, cache=cache_got, first=46,
                       until=52)
    tol = 1e-4 if dtype == torch.float32 else BF16_LOGIT_TOL
    gap = (got - want).abs().max().item()
    print(f"max |fused - modular| logit, {which}, {dtype}: {gap:.2e}")
    assert gap <= tol * max(1.0, want.abs().max().item() / 10)
    _assert_caches_equal(cache_got, cache_want, 1e-4 if dtype == torch.float32 else 5e-2)


@needs_triton
@pytest.mark.parametrize("sparsity", [pytest.param(None, marks=pytest.mark.slow),
                                      Schedule((0, 96), (48, 64))], ids=["dense", "schedule"])
def test_engine_fused_triton_equals_teacher_forced(sparsity, qwen3_path):
    """The engine on the GPU runner's path (the inference form, the Triton kernels; the static padded
    step that CUDA graphs replay), fp32: every sampled token's logprob equals teacher-forced scoring
    within 1e-4, prompts of 70 and 30 tokens x 2 samples x 5 tokens (batches padded to 3 rows)."""
    model = _load(qwen3_path)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 30)]
    params = SamplingParams(max_new_tokens=5, n=2, seed=5, temperature=1.0, ignore_eos=True)
    step = DecodeStep.EAGER if DEVICE == "cpu" else DecodeStep.GRAPHS
    engine = Engine(model, as_policy(sparsity), EngineConfig(max_batch=3, dense_layers=(0,),
                                                             kernels=Backend.TRITON, decode_step=step))
    assert engine.runner.decode_form is not None and engine.runner.decode_form.usable()
    results = engine.generate(prompts, params)
    budget_at = budget_fn(sparsity)
    for samples in results:
        scored = score_sequences(model, [c.prompt_token_ids for c in samples], [c.token_ids for c in samples],
                                 [budget_at] if budget_at else [], dense_layers=(0,))
        want = scored.sparse[budget_at][1] if budget_at else scored.logp_dense
        got = np.concatenate([c.logprobs for c in samples])
        assert np.abs(got - want).max() <= 1e-4


@in_fresh_process
def test_in_fresh_process(request):
    """Fallback when triton was imported before TRITON_INTERPRET=1: rerun this module in a new process."""
    rerun_in_fresh_process(request, __file__)


def test_copy_of_a_stacked_model_is_independent(qwen3_path):
    """A deep copy of a stacked model owns its weights (the trainer's reference model, a test's copy):
    updating one changes nothing in the other, and stacking the copy moves only the copy."""
    model = _load(qwen3_path)
    form = GpuDecode(model, ops.TORCH)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.layers[0].attn.q_proj.weight.add_(1.0)
    assert not torch.equal(twin.layers[0].attn.q_proj.weight, model.layers[0].attn.q_proj.weight)
    assert form.qkv[0].in_place()
    GpuDecode(twin, ops.TORCH)
    assert form.qkv[0].in_place()
