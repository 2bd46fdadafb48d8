"""A rollout on a CPU with the C++ kernels does not depend on --max-num-seqs (up to 16) at a given thread
count: the same tokens and the same logprobs, bit for bit. The prefill stacks the prompts admitted together
into one product, and torch's CPU product (MKL) rounds a row by how many rows share the call at 2 threads;
the engine's prefill products (`row_exact_linears`) must not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparrow.kernels import cpu_attention
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.cpu.packed_linears import packing_available, row_exact_linears


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 59, 80, 160])
def test_a_prefill_product_rounds_a_row_alike_with_any_rows_beside_it(two_threads, rows):
    """SmolLM2's down projection (1536 -> 576), whose MKL product at 2 threads rounds rows 59..160 apart
    from the same rows among 240: each row as among 240, and within float rounding of float64."""
    torch.manual_seed(0)
    linear = nn.Linear(1536, 576, bias=False)
    x = torch.randn(240, 1536)
    with torch.inference_mode(), row_exact_linears(linear):
        full, part = linear(x), linear(x[:rows])
    assert torch.equal(part, full[:rows])
    exact = x[:rows].double() @ linear.weight.double().T
    assert (part.double() - exact).abs().max() < 1e-4


def _rollouts(model, prompts, max_batch: int, budget: int | None):
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    with Engine(model, as_policy(budget), EngineConfig(max_batch=max_batch)) as engine:
        return [c for cs in engine.generate(prompts, params) for c in cs]


@pytest.mark.parametrize("budget", [None, pytest.param(48, marks=pytest.mark.slow)])
def test_rollouts_are_the_same_with_any_max_batch_up_to_16(smollm2, two_threads, budget):
    """Three prompts of 80, 59 and 56 tokens (admitted one, two or three to a prefill), 2 samples each:
    every --max-num-seqs gives what --max-num-seqs 16 gives, tokens and logprobs bit for bit."""
    if not packing_available(smollm2.model):
        pytest.skip("no oneDNN here")
    if not cpu_attention.available():
        pytest.skip("no C++ kernels: the torch paths pad decode attention to the batch's longest sequence")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 5000, (n,), generator=gen).tolist() for n in (80, 59, 56)]
    ref = _rollouts(smollm2.model, prompts, 16, budget)
    for max_batch in (1, 2, 4):
        got = _rollouts(smollm2.model, prompts, max_batch, budget)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a.logprobs, b.logprobs, err_msg=f"max_batch {max_batch}")
