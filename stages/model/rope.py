"""Rotary position tables, with a checkpoint's rope scaling applied as transformers applies it.

Every path (the learner, teacher-forced scoring, the engine's prefill and decode on either device) reads
the model's `rope_cos` / `rope_sin` buffers, so scaling is applied here once for all of them. The types
are those `config.RopeScaling` accepts, each a fixed function of the position (transformers'
`modeling_rope_utils`): linear divides every frequency by the factor; llama3 divides the low
frequencies by the factor, keeps the high ones and interpolates between; yarn blends interpolated and
original frequencies over a ramp between the beta_fast and beta_slow rotation counts and scales
cos/sin by its attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig, RopeScaling


def rope_tables(cfg: ModelConfig, max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [S, D] float32 for positions 0..S-1 (S = the model's context by default), Hugging Face's
    half-rotation layout, scaled by the rope type's attention factor."""
    inv_freq, scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(max_len or cfg.max_position_embeddings, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """The inverse frequencies [D/2] and the factor that multiplies cos and sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"rope scaling type {scaling.rope_type!r} is not supported")


def _llama3(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[Tensor, float]:
    factor = s.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(factor))
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        context = s.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)
