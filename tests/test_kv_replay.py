"""Teacher-forced scoring under eviction (stages/attention/eviction_replay.py via `score_sequences`) against
the float64 brute-force decoder of eviction_reference.py, and the replay's retained cache against a
dense forward (kept keys are the dense keys of their original positions: RoPE unchanged).

The layer-0 check compares within 1e-5, not bit for bit: the replay's forwards have other shapes than
the dense one's, so the projections round differently; a key rotated at another position would be
off by far more."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eviction_reference import brute_force_logprobs, float64_copy

from sparrow.stages.attention.eviction_replay import replay
from sparrow.stages.kv_policies import RKV, SnapKV
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.mismatch import score_sequences


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-qwen3").model


def _tokens(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


POLICIES = [SnapKV(40, window=6, buffer=16, sink=4), RKV(40, window=6, buffer=16, sink=4)]


@pytest.mark.parametrize("policy", POLICIES, ids=["snapkv", "rkv"])
def test_replay_scores_what_brute_force_decoding_gives(tiny, policy):
    """Prompts shorter than the budget, between budget and budget + buffer, and longer than both (the
    first compression right after the first decode step), two sharing a length: several compressions
    each; logprobs within fp32-vs-float64 rounding, and eviction changed them (vs dense)."""
    prompts = _tokens((20, 47, 80, 80), seed=1)
    completions = _tokens((70, 65, 50, 58), seed=2)
    scored = score_sequences(tiny, prompts, completions, [policy], temperature=1.0)
    _, logp = scored.sparse[policy]
    model64 = float64_copy(tiny)
    expected = np.concatenate([brute_force_logprobs(model64, p, c, policy)[0]
                               for p, c in zip(prompts, completions)])
    assert np.abs(logp - expected).max() <= 2e-4
    assert np.abs(logp - scored.logp_dense).max() > 1e-2  # eviction mattered
    alpha = scored.sparse[policy][0]
    assert alpha.min() < 0.999 and alpha.max() <= 1.0


def test_replay_keeps_original_positions_sink_and_window(tiny):
    """After the replay, layer 0's kept keys are exactly the dense keys of their positions (layer 0's
    keys do not depend on attention), the sink and the last `window` positions are kept in every
    head, and the kept positions match the brute force's."""
    policy = RKV(32, window=5, buffer=12, sink=3)
    prompt, completion = _tokens((30,), seed=3)[0], _tokens((41,), seed=4)[0]
    fed = completion[:-1]
    with torch.inference_mode():
        r = replay(tiny, torch.tensor([prompt]), torch.tensor([fed]), policy)
        captured = {}

        def grab(layer, q, k, v, ctx):
            captured.setdefault(layer, k)
            from sparrow.stages.model.llama import DenseAttention

            return DenseAttention()(layer, q, k, v, ctx)

        tokens = torch.tensor([prompt + fed])
        tiny.hidden_states(tokens, positions=torch.arange(tokens.shape[1])[None], attention=grab)
    positions = r.state.positions[0][0]  # [Hkv, L]
    total = len(prompt) + len(fed)
    assert positions.shape[1] == policy.cache_len(len(prompt), len(fed)) < total
    dense_k = captured[0][0]  # [Hkv, T, D]
    kept_k = r.state.k[0][0]
    for h in range(positions.shape[0]):
        assert torch.allclose(kept_k[h], dense_k[h, positions[h]], atol=1e-5)  # products' rounding only
        assert positions[h, :3].tolist() == [0, 1, 2]
        assert positions[h, -policy.window:].tolist() == list(range(total - policy.window, total))
    _, kept = brute_force_logprobs(float64_copy(tiny), prompt, completion, policy)
    for layer in range(tiny.cfg.num_layers):
        assert r.state.positions[layer][0].tolist() == kept[layer]
