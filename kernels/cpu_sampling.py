"""The exponential race of a decode step's sampled rows in one C++ pass (kernels/cpu_sampling.cpp).

The torch sampler draws a row's noise with `uniform_` from the sample's `torch.Generator` (a Mersenne
twister, a visible share of a small model's CPU step), then takes the log, divides and arg-maxes in four
more passes over the rows. Here each sampled row draws one 64-bit seed
from its generator, and one pass per row computes argmax_v log p_v - ln E_v, E_v = -ln U_v, with U_v from
splitmix64 of (seed, v): the same exact race (argmax p / E with E ~ Exp(1) draws v with probability p_v), a
counter based noise instead of the twister's stream. In fp32 the largest U cell (its 24 bits all ones)
rounds to U = 1, so E is floored at 2^-25, that cell's exact -ln U (without the floor such a token, one in
2^24, won whatever its probability: a 49K-token row once in about 340 draws). A sample's draws still depend
only on its own generator, so not on the batch it shares. `race_sample_reference` computes the same bits
and race in float64 numpy (where the floor never binds).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import cpu_attention

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def usable(logp: Tensor) -> bool:
    return logp.device.type == "cpu" and logp.dtype == torch.float32 and cpu_attention.available()


def draw_seeds(generators) -> Tensor:
    """One 64-bit seed per row from its generator -> [B] int64."""
    return torch.stack([torch.empty((), dtype=torch.int64).random_(generator=g) for g in generators])


def race_sample(logp: Tensor, seeds: Tensor) -> Tensor:
    """logp [B, V] fp32 log-probabilities, seeds [B] int64 -> drawn tokens [B] int64."""
    return torch.ops.sparrow_cpu.race_sample(logp.contiguous(), seeds)


def noise_bits(seed: int, vocab: int) -> np.ndarray:
    """The 32 random bits of each token v of a row: a half of splitmix64(seed + (v // 2 + 1) * golden)."""
    v = np.arange(vocab, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed % 2**64) + (v // np.uint64(2) + np.uint64(1)) * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return np.where(v % np.uint64(2) == 0, z & np.uint64(0xFFFFFFFF), z >> np.uint64(32))


def race_sample_reference(logp: Tensor, seeds: Tensor) -> Tensor:
    """`race_sample` in float64: U = (24 high bits + 0.5) / 2^24, argmax log p - ln(-ln U)."""
    out = []
    for row, seed in zip(logp.double().numpy(), seeds.tolist()):
        u = ((noise_bits(seed, len(row)) >> np.uint64(8)).astype(np.float64) + 0.5) / 2**24
        out.append(int(np.argmax(row - np.log(-np.log(u)))))
    return torch.tensor(out)
