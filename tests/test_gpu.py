"""The engine's GPU path end to end, on a CUDA device (skipped elsewhere; `bench/gpu_checks.sh` runs it).

On CUDA the engine runs the compiled Triton kernels and replays its decode step from CUDA graphs. The
contracts that the CPU tests hold for the torch path are held here for that path, against independent
references on the same device: greedy tokens equal `transformers` (fp32), and the engine's sampled-token
logprobs equal teacher-forced scoring (`score_sequences`, contiguous SDPA-free torch attention) within
1e-4 in fp32 (IEEE fp32 dots in the kernels) and within a stated tolerance in bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from sparrow.stages.kv_policies import RKV, SnapKV
from sparrow.stages.mismatch import score_sequences
from sparrow.stages.model.loading import load_model
from sparrow.stages.rollout import Engine, SamplingParams
from sparrow.stages.schedule import Schedule
from sparrow.stages.sparsity import budget_fn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# bf16 engine vs bf16 teacher-forced scoring: the two round differently (paged flash-decoding with bf16
# P@V vs a contiguous fp32-softmax reference over bf16 K/V), so logprobs agree to about 1e-2.
BF16_LOGPROB_TOL = 0.1


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A tiny Qwen3 saved by transformers, the same checkpoint loaded by both sides, on CUDA."""
    cfg = transformers.Qwen3Config(vocab_size=300, hidden_size=128, intermediate_size=192,
                                   num_hidden_layers=4, head_dim=32, num_attention_heads=8,
                                   num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=2048,
                                   rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path_factory.mktemp("tiny-qwen3-gpu")
    hf.save_pretrained(path, safe_serialization=True)
    return hf.cuda(), str(path)


def _prompts(lengths, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_cuda_graph_engine_greedy_matches_transformers(tiny_qwen3):
    hf, path = tiny_qwen3
    model = load_model(path, device="cuda").model
    prompts = _prompts((7, 40, 130))
    engine = Engine(model, max_batch=4)
    assert engine.decode_graphs == "cuda"
    results = engine.generate(prompts, SamplingParams(max_new_tokens=48, temperature=0.0, n=2,
                                                      ignore_eos=True))
    assert engine.runner.static is not None and engine.runner.static.graphs
    for prompt, samples in zip(prompts, results):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=48, min_new_tokens=48,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert [c.token_ids for c in samples] == [want, want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sparsity", [None, 64, Schedule((0, 320, 480), (64, 128, 192))],
                         ids=["dense", "budget64", "schedule"])
def test_cuda_graph_engine_logprobs_equal_teacher_forced(tiny_qwen3, sparsity, dtype):
    """Sampled at T=1, ragged prompts, 3 samples sharing each prefill, max_batch 5 < 9 sequences (so
    batches shrink and grow across graph buckets): every logprob equals teacher-forced scoring."""
    model = load_model(tiny_qwen3[1], device="cuda", dtype=dtype).model
    prompts = _prompts((300, 97, 450))
    params = SamplingParams(max_new_tokens=40, n=3, seed=11, temperature=1.0, ignore_eos=True)
    engine = Engine(model, sparsity, max_batch=5)
    results = engine.generate(prompts, params)
    assert engine.runner.static is not None and engine.runner.static.graphs
    budget_at = budget_fn(sparsity)
    gaps = []
    for samples in results:
        scored = score_sequences(model, [c.prompt_token_ids for c in samples], [c.token_ids for c in samples],
                                 [budget_at] if budget_at else [], temperature=1.0)
        want = scored.sparse[budget_at][1] if budget_at else scored.logp_dense
        got = np.concatenate([c.logprobs for c in samples])
        gaps.append(np.abs(got - want).max())
    tol = 1e-4 if dtype == torch.float32 else BF16_LOGPROB_TOL
    print(f"max |engine - teacher forced| logprob, {dtype}, {sparsity}: {max(gaps):.2e}")
    assert max(gaps) <= tol
    assert engine.blocks.used == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [SnapKV(64, window=8, buffer=32), RKV(64, window=8, buffer=32)],
                         ids=["snapkv", "rkv"])
def test_cuda_graph_eviction_equals_replay_and_preempts(tiny_qwen3, policy, dtype):
    """KV compression under CUDA graphs (the query ring written inside the captured step, compaction
    between replays): in fp32 every logprob equals teacher-forced replay of the eviction within 1e-4;
    in bf16, where a near tie in the kept set may go either way between the paged and the contiguous
    rounding, the run completes with compressions and finite logprobs. A pool too small for everyone
    preempts, rebuilds the victims by replay and (fp32) samples the same tokens."""
    model = load_model(tiny_qwen3[1], device="cuda", dtype=dtype).model
    prompts = _prompts((20, 90, 150))
    params = SamplingParams(max_new_tokens=120, n=2, seed=3, temperature=1.0, ignore_eos=True)
    engine = Engine(model, policy, max_batch=6)
    results = engine.generate(prompts, params)
    assert engine.runner.static is not None and engine.runner.static.graphs
    assert engine.stats.compactions > 0 and engine.blocks.used == 0
    gaps = []
    for samples in results:
        scored = score_sequences(model, [c.prompt_token_ids for c in samples], [c.token_ids for c in samples],
                                 [policy], temperature=1.0)
        gaps.append(np.abs(np.concatenate([c.logprobs for c in samples]) - scored.sparse[policy][1]).max())
    print(f"max |engine - replay| logprob, {dtype}, {policy.spec()}: {max(gaps):.2e}")
    if dtype == torch.bfloat16:
        assert all(np.isfinite(c.logprobs).all() for group in results for c in group)
        return
    assert max(gaps) <= 1e-4
    small = Engine(model, policy, max_batch=6, num_pages=16)
    again = small.generate(prompts, params)
    assert small.stats.preemptions > 0 and small.blocks.used == 0
    for a, b in zip(results, again):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_fp32_head_and_the_chunked_learner_on_cuda(tiny_qwen3):
    """bf16 weights on CUDA: the head's logits are the fp32 accumulation of the bf16 products (the float64
    product within fp32 rounding, far finer than bf16's), its gradient is the bf16 product's; the learner's
    logprobs over chunks of 3 positions equal one chunk, and per-layer checkpointing leaves the logprobs
    and the gradient of a LoRA as they are (within bf16 rounding)."""
    from sparrow.stages.train.adapter import add_lora
    from sparrow.stages.train.policy import completion_logprobs

    model = load_model(tiny_qwen3[1], device="cuda", dtype=torch.bfloat16).model
    w = model.lm_head.weight
    h = torch.randn(7, w.shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(0)).bfloat16()
    want = h.double() @ w.double().T
    got = model.logits(h.requires_grad_())
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    got.sum().backward()
    grad_want = torch.ones(7, w.shape[0], device="cuda").double() @ w.double()
    assert (h.grad.double() - grad_want).abs().max() < 1e-2 * grad_want.abs().max()

    prompts = _prompts((90, 90, 90, 40))
    comps = _prompts((12, 5, 17, 9), seed=2)
    with torch.no_grad():
        one = completion_logprobs(model, prompts, comps, 1.0, chunk=1024)
        three = completion_logprobs(model, prompts, comps, 1.0, chunk=3)
    assert (one.logp - three.logp).abs().max() < 1e-4 and (one.entropy - three.entropy).abs().max() < 1e-3
    torch.manual_seed(0)
    add_lora(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    runs = []
    for on in (False, True):
        model.gradient_checkpointing = on
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, prompts, comps, 1.0, chunk=3, entropy=False).logp
        logp.sum().backward()
        runs.append((logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    assert (a - b).abs().max() < 1e-3 and ga.keys() == gb.keys() and ga
    for name in ga:
        assert (ga[name].float() - gb[name].float()).abs().max() <= 2e-2 * ga[name].float().abs().max() + 1e-6
