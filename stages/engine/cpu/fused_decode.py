"""The CPU decode step (bf16 or fp32) as two C++ ops per layer around the attention.

`decode_qkv` (input RMSNorm, stacked q/k/v product, q/k norms, rotary embedding) and `decode_mlp` (o_proj,
residual, RMSNorm, stacked gate/up, silu, down, residual) round where the eager modules round and use the
same products, so the logits are the modular step's bit for bit. Used where every projection is packed
for our product; otherwise the engine runs the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparrow.kernels.ops import CPU

from ...model.llama import Attention, AttentionContext, Transformer
from .packed_linears import PackedLinears


class FusedCpuDecode:
    def __init__(self, model: Transformer, packed: PackedLinears):
        self.model, self.packed = model, packed
        self.layers: list[tuple[Tensor, ...]] | None = None  # per layer: its packed qkv, o, gate_up, down
        self.lm_head: Tensor | None = None

    def ready(self) -> bool:
        """Repack changed weights; whether every projection is packed for the fused ops."""
        if self.packed.refresh() or self.layers is None:
            self.layers, self.lm_head = self._layer_weights(), self.packed.dot_weight(self.model.lm_head)
        return bool(self.layers) and self.lm_head is not None

    def _layer_weights(self) -> list[tuple[Tensor, ...]]:
        dot = self.packed.dot_weight
        out = []
        for block in self.model.layers:
            a, m = block.attn, block.mlp
            weights = (dot(a.q_proj), dot(a.o_proj), dot(m.gate_proj), dot(m.down_proj))
            if any(w is None for w in weights):
                return []
            out.append(weights)
        return out

    def hidden(self, tokens: list[int], positions: list[int], attention: Attention) -> Tensor:
        """One decode token per row -> final normed hidden states [B, H] (call `ready` first); the runner's
        head (`CpuRunner._head`) turns them into logits."""
        model, cfg = self.model, self.model.cfg
        eps, hq, hkv = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads
        pos = torch.tensor(positions)
        ctx = AttentionContext(pos[:, None], None, max(positions) + 1)
        dtype = model.embed_tokens.weight.dtype
        cos, sin = model.rope_cos[pos].to(dtype), model.rope_sin[pos].to(dtype)  # [B, D]
        x = F.embedding(torch.tensor(tokens), model.embed_tokens.weight)  # [B, H]
        ops = CPU
        for i, (block, (qkv_w, o_w, gate_up_w, down_w)) in enumerate(zip(model.layers, self.layers)):
            a = block.attn
            q, k, v = ops.decode_qkv(x, block.input_layernorm.weight, qkv_w, _stacked_bias(a),
                                     _weight(a, "q_norm"), _weight(a, "k_norm"), cos, sin, hq, hkv, eps)
            out = attention(i, q[:, :, None], k[:, :, None], v[:, :, None], ctx)  # [B, Hq, 1, D]
            x = ops.decode_mlp(x, out.reshape(x.shape[0], -1).contiguous(), o_w, a.o_proj.bias,
                               block.post_attention_layernorm.weight, gate_up_w, down_w, eps)
        return ops.rms_norm(x, model.norm.weight, model.norm.eps)


def _stacked_bias(attn) -> Tensor | None:
    if attn.q_proj.bias is None:
        return None
    return torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()


def _weight(attn, norm: str) -> Tensor | None:
    module = getattr(attn, norm, None) if attn.cfg.qk_norm else None
    return None if module is None else module.weight
