"""Teacher-forced sparse scoring against incremental sparse decoding (the central invariant)."""

import numpy as np
import pytest
import torch

from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import budget_fn
from sparrow.stages.engine import SamplingParams
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.generate import sample
from sparrow.stages.scoring.mismatch import score_sequences


def _check_tf_equals_decode(model, prompts, sampler, max_new, tol, dense_layers=(0, 1)):
    budget_at = budget_fn(sampler)
    gens = sample(model, prompts, SamplingParams(max_new_tokens=max_new, seed=3), budget_at,
                  dense_layers=dense_layers)
    completions = [g.tokens for g in gens]
    scored = score_sequences(model, prompts, completions, [budget_at], dense_layers=dense_layers)
    _, logp_sparse = scored.sparse[budget_at]
    decoded = np.concatenate([g.logprobs for g in gens])
    assert np.abs(logp_sparse - decoded).max() <= tol
    return scored, gens


def test_tiny_teacher_forced_equals_decode_fixed_budget_and_schedule():
    m = load_model("tiny-qwen3").model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 97, 210)]
    scored, _ = _check_tf_equals_decode(m, prompts, "budget:64", 60, 1e-4, dense_layers=(0,))
    alpha = scored.sparse[next(iter(scored.sparse))][0]
    assert alpha.min() < 0.999  # sparsity actually changed something
    schedule = Schedule((0, 160, 240), (48, 80, 128))
    _check_tf_equals_decode(m, prompts, schedule, 60, 1e-4, dense_layers=())


def test_full_budget_is_dense_on_smollm2(smollm2):
    tok = smollm2.tokenizer
    prompt = tok("The sparrow is a small bird that " * 20).input_ids
    gens = sample(smollm2.model, [prompt], SamplingParams(max_new_tokens=24), None)
    scored = score_sequences(smollm2.model, [prompt], [gens[0].tokens], [1024])
    alpha, logp_sparse = scored.sparse[1024]
    assert np.all(np.abs(alpha - 1) <= 1e-5)
    assert np.abs(logp_sparse - scored.logp_dense).max() <= 1e-5
    assert np.abs(scored.logp_dense - np.array(gens[0].logprobs)).max() <= 1e-4


@pytest.mark.parametrize("sampler", ["budget:96", Schedule((0, 400), (64, 128))])
def test_smollm2_teacher_forced_equals_decode(smollm2, sampler):
    tok = smollm2.tokenizer
    text = " ".join(f"key{i} = {i * 37 % 101};" for i in range(60)) + " What is key7?"
    prompt = tok(text).input_ids
    assert len(prompt) > 300
    scored, gens = _check_tf_equals_decode(smollm2.model, [prompt, prompt[:250]], sampler, 40, 1e-4)
    alpha = scored.sparse[next(iter(scored.sparse))][0]
    assert alpha.min() < 0.99


def test_ragged_batch_scores_like_one_at_a_time():
    """Short prompt + short completion next to long ones (padding must not collide with real slots)."""
    m = load_model("tiny-qwen3").model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (60, 200, 130)]
    completions = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (10, 90, 40)]
    batched = score_sequences(m, prompts, completions, [48, 96], dense_layers=(0,))
    singles = [score_sequences(m, [p], [c], [48, 96], dense_layers=(0,))
               for p, c in zip(prompts, completions)]
    assert np.array_equal(batched.position, np.concatenate([s.position for s in singles]))
    for k in (48, 96):
        for i in (0, 1):
            expected = np.concatenate([s.sparse[k][i] for s in singles])
            assert np.abs(batched.sparse[k][i] - expected).max() <= 1e-4
    assert np.abs(batched.logp_dense - np.concatenate([s.logp_dense for s in singles])).max() <= 1e-4
