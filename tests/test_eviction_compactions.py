"""The rollout summary's `compactions` counts every compression an evicting sample's cache went through,
once, whether the scheduler ran it or a preempted sample's recompute replayed it: a pool that preempts
reports what a pool that never preempts reports for the same samples, and both equal the compressions
the samples' own `kv_lens` show (each one drops the cache back to the budget)."""

from __future__ import annotations

import pytest
import torch

from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.kv_policies import RKV, SnapKV
from sparrow.stages.model.loading import load_model

SNAP = SnapKV(40, window=6, buffer=16, sink=4)


@pytest.mark.parametrize("cls", [SnapKV, RKV])
@pytest.mark.parametrize("prompt", [5, 37, 100])
def test_compressions_follow_the_token_by_token_rule(cls, prompt):
    """A simulation: append one token per step, compress to the budget after a step that leaves budget +
    buffer tokens or more, and count."""
    policy = cls(40, window=8, buffer=24, sink=4)
    cached, count = prompt, 0
    for fed in range(1, 300):
        cached += 1
        if cached >= policy.capacity:
            cached, count = policy.budget, count + 1
        assert policy.compressions(prompt, fed) == count
    assert policy.compressions(prompt, 0) == 0


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3").model


def _generate(model, num_pages: int | None):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (70, 45, 100)]
    params = SamplingParams(max_new_tokens=90, n=2, seed=5, temperature=1.0, ignore_eos=True)
    engine = Engine(model, as_policy(SNAP), EngineConfig(max_batch=6, num_pages=num_pages))
    return engine, [c for group in engine.generate(prompts, params) for c in group]


def _drops(samples) -> int:
    """The compressions the samples' recorded cache lengths show."""
    return sum(b < a for c in samples for a, b in zip(c.kv_lens, c.kv_lens[1:]))


def test_a_preempted_sample_s_replayed_compression_is_counted(tiny):
    big, ref = _generate(tiny, None)
    small, got = _generate(tiny, 12)  # preempts samples due a compression: their recompute replays it
    assert big.stats.preemptions == 0 < small.stats.preemptions
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert [c.kv_lens for c in got] == [c.kv_lens for c in ref]
    assert big.stats.compactions == _drops(ref) > 0
    assert small.stats.compactions == big.stats.compactions
