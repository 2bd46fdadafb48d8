"""One Llama-family decoder (Llama, Qwen2, Qwen3) with pluggable attention.

Design: the decoder owns projections, norms, RoPE and the MLP; *what the queries attend to* is
delegated to an `Attention` object called once per layer with post-RoPE q, k, v. Dense attention,
block top-k sparse decode and teacher-forced sparse scoring are all such objects, so the model code
never changes when the attention does. Positions are cache slots: token i of a sequence lives in
slot i of its KV cache and gets RoPE position i, so pages are aligned to positions by construction.
Parameter names follow Hugging Face's with the `model.` prefix dropped (see `hf_to_ours`).

The head: `Transformer.logits` is the one way from final hidden states to logits, and they are fp32
whatever the weights' dtype. With bf16 weights the product accumulates in fp32 and is not rounded to
bf16 afterwards (on CUDA cuBLAS's fp32 output, `head.fp32_product`; on a CPU an fp32 copy of the head's
weight), so the engine, the learner and teacher-forced scoring differ only by summation order, not by a
bf16 rounding of every logit that depends on the GEMM's shape.

`gradient_checkpointing` (off by default; the learner turns it on) recomputes each decoder layer in the
backward pass (`torch.utils.checkpoint`, non-reentrant): a differentiable forward then keeps one
[B, T, hidden] input per layer instead of every intermediate. It acts only where gradients are
recorded, so inference paths are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .head import fp32_product
from .rope import rope_tables

MASK_ELEMENTS = 1 << 26  # a masked attention call keeps its [B, queries, keys] mask below this


@dataclass
class KVCache:
    """Per-sequence KV cache: slot i holds the keys/values of the token at position i."""

    k: Tensor  # [L, B, Hkv, S, D]
    v: Tensor  # [L, B, Hkv, S, D]
    lengths: Tensor  # [B] int64: valid slots per sequence

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32,
                 device="cpu") -> KVCache:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at slots `positions` [B, T]."""
        idx = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)


@dataclass
class AttentionContext:
    positions: Tensor  # [B, T] position (= cache slot) of each new token
    cache: KVCache | None  # None: the tokens are the whole sequence (teacher forced)
    kv_len: int  # slots in use after this step (max over the batch)
    starts_at_zero: bool = False  # every sequence's new tokens sit at positions 0..T-1


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] (post-RoPE) -> output [B, Hq, T, D]."""
        ...


class DenseAttention:
    """Exact causal softmax attention over everything cached so far."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        keys, values = cached_kv(layer, k, v, ctx)
        if ctx.starts_at_zero and q.shape[2] == keys.shape[2]:
            # Whole sequences (or prefill into an empty cache): plain causal, no [T, S] mask.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return masked_attention(q, keys, values, ctx.positions)


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                     max_elements: int = MASK_ELEMENTS) -> Tensor:
    """Queries q [B, Hq, T, D] at `positions` [B, T] attending to the keys [B, Hkv, S, D] of slots
    0..position, in chunks of queries whose [B, 1, chunk, S] masks stay under `max_elements`."""
    b, t, s = q.shape[0], q.shape[2], keys.shape[2]
    chunk = max(1, min(t, max_elements // max(b * s, 1)))
    key_pos = torch.arange(s, device=q.device)
    out = []
    for lo in range(0, t, chunk):
        pos = positions[:, lo:lo + chunk]
        mask = key_pos[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, chunk, S]
        out.append(F.scaled_dot_product_attention(q[:, :, lo:lo + chunk], keys, values, attn_mask=mask,
                                                  enable_gqa=True))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def cached_kv(layer: int, k: Tensor, v: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
    """Append the new k/v to the cache (if any) and return all keys/values [B, Hkv, S, D]."""
    if ctx.cache is None:
        return k, v
    ctx.cache.write(layer, k, v, ctx.positions)
    return ctx.cache.k[layer, :, :, : ctx.kv_len], ctx.cache.v[layer, :, :, : ctx.kv_len]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # fp32 at least (float64 stays float64)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D] (Hugging Face's half-rotation convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The three projections (the CPU decode step swaps in one product over their stacked weights)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention,
                ctx: AttentionContext) -> Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q, k, v = self.qkv(x)
        q, k, v = q.view(b, t, -1, d), k.view(b, t, -1, d), v.view(b, t, -1, d).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, Hq, T, D], [B, Hkv, T, D]
        out = attention(self.layer, q, k, v, ctx)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention,
                ctx: AttentionContext) -> Tensor:
        x = x + self.attn(self.input_layernorm(x), cos, sin, attention, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.gradient_checkpointing = False
        self._head_fp32: tuple[tuple, Tensor] | None = None  # (weight's identity, its fp32 copy): CPU only

    def hidden_states(self, tokens: Tensor, cache: KVCache | None = None,
                      positions: Tensor | None = None, attention: Attention | None = None,
                      kv_len: int | None = None) -> Tensor:
        """tokens [B, T] -> final normed hidden states [B, T, hidden].

        With a cache, the new tokens go to slots `positions` (default: right after each sequence's
        cached length); the caller advances `cache.lengths` by the number of real tokens.
        `kv_len`: a bound on the positions that the caller guarantees (no check); giving it keeps the
        forward free of device-to-host syncs, which CUDA graph capture needs.
        """
        b, t = tokens.shape
        if positions is None:
            start = cache.lengths[:, None] if cache is not None else 0
            positions = start + torch.arange(t, device=tokens.device)[None, :].expand(b, t)
        if kv_len is None:
            kv_len = int(positions.max()) + 1
            if kv_len > self.cfg.max_position_embeddings or (cache is not None and kv_len > cache.capacity):
                raise ValueError(f"position {kv_len - 1} is beyond the model's context or the cache")
            starts_at_zero = kv_len == t and bool((positions[:, 0] == 0).all())
        else:
            starts_at_zero = False
        ctx = AttentionContext(positions, cache, kv_len, starts_at_zero)
        cos = self.rope_cos[positions][:, None].to(self.embed_tokens.weight.dtype)  # [B, 1, T, D]
        sin = self.rope_sin[positions][:, None].to(self.embed_tokens.weight.dtype)
        attention = attention or DenseAttention()
        x = self.embed_tokens(tokens)
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for block in self.layers:
            if recompute:
                x = checkpoint(block, x, cos, sin, attention, ctx, use_reentrant=False)
            else:
                x = block(x, cos, sin, attention, ctx)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states [..., hidden] -> logits [..., vocab] in fp32, or in the weights' dtype when
        that is wider (a test's float64 model); see the module docstring."""
        weight = self.lm_head.weight
        if weight.dtype not in (torch.bfloat16, torch.float16):
            return self.lm_head(hidden)  # the module: the CPU engine's packed product applies
        if weight.device.type == "cuda":
            return fp32_product(hidden, weight)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return F.linear(hidden.float(), weight.float())
        return F.linear(hidden.float(), self._fp32_head_weight())

    def _fp32_head_weight(self) -> Tensor:
        """An fp32 copy of a 16-bit head weight on a CPU, made again whenever the weight changed."""
        weight = self.lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._head_fp32 is None or self._head_fp32[0] != key:
            self._head_fp32 = None
            with torch.no_grad():
                self._head_fp32 = (key, weight.float())
        return self._head_fp32[1]

    def forward(self, tokens: Tensor, cache: KVCache | None = None, positions: Tensor | None = None,
                attention: Attention | None = None) -> Tensor:
        """tokens [B, T] -> logits [B, T, vocab] (float32)."""
        return self.logits(self.hidden_states(tokens, cache, positions, attention))


def hf_to_ours(name: str) -> str:
    """Hugging Face parameter name -> this module's name."""
    name = name.removeprefix("model.")
    return name.replace(".self_attn.", ".attn.")


def ours_to_hf(name: str) -> str:
    name = name.replace(".attn.", ".self_attn.")
    return name if name.startswith("lm_head") else "model." + name
