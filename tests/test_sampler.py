"""The batched sampler against the distributions it must draw from (brute-force frequencies)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparrow.kernels import ops
from sparrow.stages.engine import SamplingParams
from sparrow.stages.engine.sampler import sample_tokens


def _frequencies(logits, params, draws=20000, seed=0):
    """Empirical token frequencies of row 0 over `draws` calls, each with its own generator state."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(logits.shape[-1])
    batch = logits.expand(500, -1)
    for _ in range(draws // 500):
        gens = [g] * 500  # one generator shared by the rows: draws stay independent
        tokens, logp, _ = sample_tokens(batch, [params] * 500, gens)
        np.add.at(counts, tokens.numpy(), 1)
    return counts / counts.sum(), logp


def _expected(logits, temperature, top_k=0, top_p=1.0):
    p = torch.softmax(logits[0].double() / temperature, -1).numpy()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0)
    p = p / p.sum()
    cum = np.cumsum(p[order]) - p[order]
    keep_p = np.zeros_like(keep)
    keep_p[order[cum < top_p]] = True
    p = np.where(keep_p, p, 0)
    return p / p.sum()


def test_sampled_frequencies_match_the_truncated_distribution():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
        freq, logp = _frequencies(logits, params)
        want = _expected(logits, temperature, top_k, top_p)
        assert np.abs(freq - want).max() < 0.015, (temperature, top_k, top_p, freq, want)
        assert freq[want == 0].sum() == 0  # truncated tokens are never drawn


def test_per_sample_generators_make_draws_independent_of_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, max_new_tokens=1)] * 6
    alone = [sample_tokens(logits[i:i + 1], params[:1], [torch.Generator().manual_seed(i)])[0].item()
             for i in range(6)]
    together = sample_tokens(logits, params, [torch.Generator().manual_seed(i) for i in range(6)])[0]
    assert together.tolist() == alone


def _assert_float64_logprobs(logits, temps, tokens, logp, top_values, top_ids):
    """Row 0 greedy (the argmax); every sampled logprob and the top-3 logprobs those of a float64
    log-softmax at the row's temperature (1 when greedy)."""
    want = torch.stack([torch.log_softmax(logits[i].double() / (t if t > 0 else 1.0), -1)
                        for i, t in enumerate(temps)])
    assert tokens[0] == logits[0].argmax()
    assert torch.allclose(logp.double(), want.gather(1, tokens[:, None])[:, 0], atol=1e-5)
    ref_values, ref_ids = want.topk(3, dim=-1)
    assert torch.equal(top_ids, ref_ids) and torch.allclose(top_values.double(), ref_values, atol=1e-5)


def test_logprobs_and_greedy_rows_against_float64_log_softmax():
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 4
    temps = (0.0, 0.7, 1.0, 1.3)
    params = [SamplingParams(temperature=t, max_new_tokens=1, logprobs=3) for t in temps]
    tokens, logp, (top_values, top_ids) = sample_tokens(logits, params, [torch.Generator().manual_seed(i)
                                                                         for i in range(4)], 3)
    _assert_float64_logprobs(logits, temps, tokens, logp, top_values, top_ids)



def test_cpu_race_kernel_draws_what_its_float64_reference_draws():
    """The C++ race (kernels/cpu_sampling.cpp: splitmix64 noise, fp32 logs) picks the token the float64
    numpy race over the same bits picks, on every row; the sampler takes it for untruncated rows (the
    frequency test above holds it to the distribution)."""
    from sparrow.kernels import cpu_sampling

    logp = torch.log_softmax(torch.randn(64, 3001, generator=torch.Generator().manual_seed(6)) * 3, -1)
    if not cpu_sampling.usable(logp):
        pytest.skip("no C++ kernels here (no AVX2 or no C++ toolchain)")
    seeds = torch.randint(-2**62, 2**62, (64,), generator=torch.Generator().manual_seed(7))
    drawn = cpu_sampling.race_sample(logp, seeds)
    assert torch.equal(drawn, cpu_sampling.race_sample_reference(logp, seeds))
    assert len(set(drawn.tolist())) > 50  # distinct seeds, distinct draws
    bits = cpu_sampling.noise_bits(12345, 100000) >> np.uint64(8)
    u = (bits.astype(np.float64) + 0.5) / 2**24
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002


# ---------------------------------------------------------------------------- the device path's sampler

def _top_cell_cases(vocab=4096, count=3):
    """(seed, token) pairs whose noise is the largest 24-bit cell (U rounds to 1 in fp32), found by
    brute force over seeds with the reference's bits."""
    from sparrow.kernels import cpu_sampling

    found = []
    for seed in range(100000):
        hit = np.nonzero((cpu_sampling.noise_bits(seed, vocab) >> np.uint64(8)) == 0xFFFFFF)[0]
        if len(hit):
            found.append((seed, int(hit[0])))
        if len(found) == count:
            return found
    raise AssertionError("no seed hits the top cell")


@pytest.mark.parametrize("kernels", [ops.CPU, ops.TORCH], ids=["cpu", "torch"])
def test_race_implementations_draw_what_the_float64_reference_draws(kernels):
    """The race in torch ops and the C++ race (the CPU ops) against the float64 numpy race over the
    same bits, on random rows; and on rows where one token's noise is the top cell, whose fp32 U rounds to
    1: that token must not win against a token holding all the mass (it did before E was floored)."""
    from sparrow.kernels import cpu_sampling

    if kernels is ops.CPU and not cpu_sampling.usable(torch.zeros(1, 1)):
        pytest.skip("no C++ kernels here")
    logp = torch.log_softmax(torch.randn(64, 3001, generator=torch.Generator().manual_seed(6)) * 3, -1)
    seeds = torch.randint(-2**62, 2**62, (64,), generator=torch.Generator().manual_seed(7))
    assert torch.equal(kernels.race_sample(logp, seeds), cpu_sampling.race_sample_reference(logp, seeds))
    cases = _top_cell_cases()
    peaked = torch.full((len(cases), 4096), -40.0)
    peaked[:, 7] = 0.0
    peaked = torch.log_softmax(peaked, -1)
    seeds = torch.tensor([seed for seed, _ in cases])
    assert kernels.race_sample(peaked, seeds).tolist() == [7] * len(cases)
    assert cpu_sampling.race_sample_reference(peaked, seeds).tolist() == [7] * len(cases)


def test_row_seeds_equal_their_uint64_reference():
    from sparrow.kernels.race_sample import row_seeds, row_seeds_reference

    g = torch.Generator().manual_seed(8)
    seeds = torch.randint(-2**63, 2**63 - 1, (257,), generator=g)
    positions = torch.randint(0, 1 << 20, (257,), generator=g)
    got = row_seeds(seeds, positions).numpy().view(np.uint64)
    assert np.array_equal(got, row_seeds_reference(seeds.numpy(), positions.numpy()))
    assert len(set(got.tolist())) == 257


def _position_frequencies(logits, params, kernels, draws=20000, rows=500):
    """Frequencies of row 0's draws by the device path, each draw keyed by its own (seed, position)."""
    from sparrow.stages.engine.sampler import sample_by_position

    counts = np.zeros(logits.shape[-1])
    batch = logits.expand(rows, -1)
    for j in range(draws // rows):
        tokens, logp, _ = sample_by_position(batch, [params] * rows, range(1000, 1000 + rows), [j] * rows,
                                             ops=kernels)
        np.add.at(counts, tokens.numpy(), 1)
    return counts / counts.sum(), logp


@pytest.mark.parametrize("kernels", [ops.CPU, ops.TORCH], ids=["cpu", "torch"])
def test_device_path_frequencies_match_the_truncated_distribution(kernels):
    """The device path's draws (the position-keyed race; top-k/top-p drawn again over the truncated set)
    against the distribution they must draw from, as the host sampler's frequency test."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
        freq, logp = _position_frequencies(logits, params, kernels)
        want = _expected(logits, temperature, top_k, top_p)
        assert np.abs(freq - want).max() < 0.015, (temperature, top_k, top_p, freq, want)
        assert freq[want == 0].sum() == 0


def test_device_path_logprobs_greedy_and_top_logprobs_against_float64():
    """Logprobs of the full distribution at the temperature (1 when greedy), greedy rows the argmax,
    top logprobs the float64 top-k; the same seed and position draw the same token in any batch."""
    from sparrow.stages.engine.sampler import sample_by_position

    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 4
    temps = (0.0, 0.7, 1.0, 1.3)
    params = [SamplingParams(temperature=t, max_new_tokens=1, logprobs=3) for t in temps]
    seeds, positions = [11, 12, 13, 14], [5, 6, 7, 8]
    tokens, logp, (top_values, top_ids) = sample_by_position(logits, params, seeds, positions, 3)
    _assert_float64_logprobs(logits, temps, tokens, logp, top_values, top_ids)
    alone = [sample_by_position(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1],
                                positions[i:i + 1])[0].item() for i in range(4)]
    assert tokens.tolist() == alone
