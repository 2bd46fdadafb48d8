"""Eviction in the rollout engine (SnapKV, R-KV: stages/kv_policies, stages/engine/compaction.py).

The independent references: the float64 brute-force decoder of eviction_reference.py (a contiguous
per-position cache, kept positions per head, the papers' rules as loops) and teacher-forced replay
(`score_sequences`, a forward per run between compressions over a contiguous cache). The engine decodes
one token at a time in a paged pool, compacting caches between steps; its logprobs must be both's, in
fp32, through the CPU runner, the padded static step and (slow) the Triton kernels; a pool too small
for the dense run must run more samples at once under compression; preemption rebuilds an evicting
sample by replay and changes nothing; every page comes back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eviction_reference import brute_force_logprobs, float64_copy

from sparrow.kernels.ops import Backend
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import DecodeStep, Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.memory import Workload
from sparrow.stages.kv_policies import RKV, SnapKV
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences

SNAP = SnapKV(40, window=6, buffer=16, sink=4)
RKV_ = RKV(40, window=6, buffer=16, sink=4)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3").model


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _generate(model, prompts, params, sparsity, **kw):
    engine = Engine(model, as_policy(sparsity), EngineConfig(**kw))
    out = engine.generate(prompts, params)
    assert engine.blocks.used == 0 and not any(engine.blocks.refcount)  # every page came back
    return engine, [c for group in out for c in group]


@pytest.mark.parametrize("policy", [SNAP, RKV_], ids=["snapkv", "rkv"])
def test_engine_decoding_equals_brute_force_and_replay(tiny, policy):
    """Prompts below the budget, between budget and budget + buffer, and above both (compressed right
    after the first decode step, the shared prompt pages copied, never written); 2 samples each."""
    prompts = _prompts((20, 47, 80))
    params = SamplingParams(max_new_tokens=70, n=2, seed=3, temperature=1.0, ignore_eos=True)
    engine, got = _generate(tiny, prompts, params, policy, max_batch=6)
    assert engine.stats.compactions >= 12
    model64 = float64_copy(tiny)
    for i, prompt in enumerate(prompts):
        samples = [c for c in got if c.request_id == i]
        logprobs = np.concatenate([c.logprobs for c in samples])
        scored = score_sequences(tiny, [prompt] * 2, [c.token_ids for c in samples], [policy])
        assert np.abs(scored.sparse[policy][1] - logprobs).max() <= 1e-4  # replay
        expected = np.concatenate([brute_force_logprobs(model64, prompt, c.token_ids, policy)[0]
                                   for c in samples])
        assert np.abs(expected - logprobs).max() <= 2e-4  # brute force, float64
        assert np.abs(scored.logp_dense - logprobs).max() > 1e-2  # eviction changed the logprobs
        for c in samples:  # the retained cache each token's query read (token 0: the prefill's)
            decoded = [policy.cache_len(len(prompt), j - 1) + 1 for j in range(1, 70)]
            assert c.kv_lens == [len(prompt)] + decoded
            assert c.budgets == [0] + [policy.budget] * 69 and c.policy == policy.spec()


def test_static_step_and_torch_references_decode_the_same(tiny):
    """The padded step that CUDA graphs replay (its query-ring index computed on the device from each
    row's ring slot and position, its compacted rows' cache lengths and block tables sent again while
    the previous step is in flight) and the torch references of the kernels give the default CPU path's
    greedy tokens; sampled on the static step (the device path's race, not the host generators), its
    logprobs are what teacher-forced replay of the same eviction gives."""
    prompts = _prompts((30, 70), seed=2)
    greedy = SamplingParams(max_new_tokens=60, n=2, seed=4, temperature=0.0, ignore_eos=True)
    _, ref = _generate(tiny, prompts, greedy, RKV_, max_batch=4)
    for kw in ({"decode_step": DecodeStep.EAGER}, {"kernels": Backend.TORCH, "cascade": False}):
        engine, got = _generate(tiny, prompts, greedy, RKV_, max_batch=4, **kw)
        assert engine.stats.compactions > 0
        for a, b in zip(ref, got):
            assert a.token_ids == b.token_ids and a.kv_lens == b.kv_lens
            assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-5
    sampled = SamplingParams(max_new_tokens=60, n=2, seed=4, temperature=1.0, ignore_eos=True)
    engine, got = _generate(tiny, prompts, sampled, RKV_, max_batch=3, decode_step=DecodeStep.EAGER)
    assert engine.stats.compactions > 0 and engine.runner.lag == 1
    for i, prompt in enumerate(prompts):
        samples = [c for c in got if c.request_id == i]
        scored = score_sequences(tiny, [prompt] * 2, [c.token_ids for c in samples], [RKV_])
        assert np.abs(scored.sparse[RKV_][1] - np.concatenate([c.logprobs for c in samples])).max() <= 1e-4


def test_preempted_evicting_samples_are_rebuilt_by_replay(tiny):
    """A pool too small for six evicting samples at once preempts; each victim's cache and query window
    are rebuilt by replay into its new pages and it goes on as it would have: same tokens, logprobs
    within fp32 noise."""
    prompts = _prompts((70, 45, 100), seed=5)
    params = SamplingParams(max_new_tokens=90, n=2, seed=5, temperature=1.0, ignore_eos=True)
    big, ref = _generate(tiny, prompts, params, SNAP, max_batch=6)
    assert big.stats.preemptions == 0
    small, got = _generate(tiny, prompts, params, SNAP, max_batch=6, num_pages=14)
    assert small.stats.preemptions >= 2 and small.stats.recomputed_tokens > 0
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-5
        assert a.kv_lens == b.kv_lens


def test_a_pool_too_small_for_dense_runs_more_samples_under_compression(tiny):
    """Eight prompts of 100 tokens, 150 new tokens each: dense, a sample needs 16 pages at full length;
    under SnapKV at budget 40 + buffer 16 it holds 7 until its first compression, then at most 4. In a
    40-page pool dense admits five and preempts over and over as they grow; compressed, the first
    compressions free the pages that admit the other three, all eight decode together and nobody is
    preempted."""
    prompts = _prompts((100,) * 8, seed=6)
    params = SamplingParams(max_new_tokens=150, seed=6, temperature=1.0, ignore_eos=True)
    dense, _ = _generate(tiny, prompts, params, None, max_batch=8, num_pages=40)
    compressed, got = _generate(tiny, prompts, params, SNAP, max_batch=8, num_pages=40)
    assert compressed.stats.max_running == 8 > dense.stats.max_running
    assert compressed.stats.preemptions == 0 < dense.stats.preemptions
    assert compressed.stats.decode_steps < dense.stats.decode_steps
    assert compressed.stats.kv_tokens_peak < dense.stats.kv_tokens_peak
    assert compressed.stats.kv_tokens_peak <= 8 * 101
    assert all(len(c.token_ids) == 150 for c in got)


def test_policies_mix_in_one_run(tiny):
    """Dense, block top-k and both eviction policies as per-request overrides of one engine run: each
    sample is what an engine of its policy alone samples."""
    prompts = _prompts((60, 60, 35, 90), seed=7)
    params = SamplingParams(max_new_tokens=60, n=2, seed=7, temperature=1.0, ignore_eos=True)
    policies = [None, 64, SNAP, RKV_]
    engine = Engine(tiny, None, EngineConfig(max_batch=8, dense_layers=(0,)))
    for i, (p, policy) in enumerate(zip(prompts, policies)):
        engine.add_request(p, params, request_id=i, policy=as_policy(policy))
    done = []
    while engine.has_work():
        done += engine.step()[0]
    done.sort(key=lambda c: (c.request_id, c.sample))
    for i, (p, policy) in enumerate(zip(prompts, policies)):
        alone = Engine(tiny, as_policy(policy), EngineConfig(max_batch=2, dense_layers=(0,)))
        ref = alone.generate([p], params, request_ids=[i])[0]  # the same request id: the same seeds
        for a, b in zip(ref, [c for c in done if c.request_id == i]):
            assert a.token_ids == b.token_ids
            assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() <= 1e-5


def test_pool_sizing_holds_compressed_samples_at_full_length():
    """`Workload.pages` for evicting requests: at most budget + buffer tokens per sample after the first
    compression, the whole prompt before it (a long prompt: prompt + 1)."""
    w = Workload.of([(40, 8, 200, SNAP)], 8, 16)
    assert w.one_sample() == 4 and w.pages() == 2 + 8 * 4 and w.longest() == 57
    long_prompt = Workload.of([(300, 4, 100, SNAP)], 4, 16)
    assert long_prompt.one_sample() == 19  # 18 full prompt pages shared, 1 page of its own (301 tokens)
    assert long_prompt.pages() == 18 + 4 * 4  # from the first compression on, 4 pages of its own
    short = Workload.of([(20, 2, 10, SNAP)], 2, 16)  # never reaches budget + buffer: dense-sized
    assert short.pages() == Workload.of([(20, 2, 10)], 2, 16).pages()


_TRITON_SCRIPT = """
import sys, torch
from sparrow.stages.kv_policies import RKV
from sparrow.stages.model.loading import load_model
from sparrow.kernels.ops import Backend
from sparrow.stages.engine import DecodeStep, Engine, EngineConfig, SamplingParams
model = load_model("tiny-qwen3").model
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (70, 41)]
params = SamplingParams(max_new_tokens=60, n=2, seed=5, ignore_eos=True)
policy = RKV(40, window=6, buffer=16)
def same(ref, got):
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids, (x.token_ids, y.token_ids)
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
ref = Engine(model, policy, EngineConfig(max_batch=4, kernels=Backend.TORCH)).generate(prompts, params)
engine = Engine(model, policy, EngineConfig(max_batch=4, kernels=Backend.TRITON, num_pages=10))
got = engine.generate(prompts, params)
assert engine.stats.compactions > 0 and engine.stats.preemptions > 0 and engine.blocks.used == 0
same(ref, got)
# the step CUDA graphs replay (eager here): the fused decode layers, the query ring's index computed on
# the device, compacted rows sent again while a step is in flight, the device path's sampling
eager = EngineConfig(max_batch=4, kernels=Backend.TORCH, decode_step=DecodeStep.EAGER, cascade=False)
ref = Engine(model, policy, eager).generate(prompts, params)
engine = Engine(model, policy, EngineConfig(max_batch=4, kernels=Backend.TRITON, num_pages=10,
                                            decode_step=DecodeStep.EAGER))
got = engine.generate(prompts, params)
assert engine.stats.compactions > 0 and engine.stats.preemptions > 0 and engine.runner.lag == 1
same(ref, got)
print("ok", engine.stats.compactions, engine.stats.preemptions)
"""


@pytest.mark.slow
def test_eviction_with_triton_kernels_under_the_interpreter():
    """The GPU code path (Triton append_kv and dense decode over compacted pages, whose seq_len is the
    retained length and not the position) through Triton's interpreter on the CPU, preempting in a
    10-page pool: the torch path's tokens. (No CUDA here: CUDA graphs are checked by bench/gpu_checks.sh.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0 and r.stdout.strip().startswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("policy", [SNAP, RKV_], ids=["snapkv", "rkv"])
def test_bf16_page_centroids_under_compaction_and_replay(tiny, policy):
    """The GPU pool keeps its page centroids in bf16: compaction and a preempted sample's rebuild write
    them in the pool's dtype, and, eviction never reading centroids, decode what an fp32 pool decodes."""
    prompts = _prompts((70, 45, 100), seed=5)
    params = SamplingParams(max_new_tokens=60, n=2, seed=5, temperature=1.0, ignore_eos=True)
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(tiny, policy, EngineConfig(max_batch=6, num_pages=14))
        engine.runner.centroid_dtype = dtype
        runs.append([c for group in engine.generate(prompts, params) for c in group])
        assert engine.runner.cache.centroids.dtype == dtype
        assert engine.stats.compactions > 0 and engine.stats.preemptions > 0
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.kv_lens == b.kv_lens
