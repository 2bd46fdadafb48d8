"""The GPU decode step's inference form of the model: stacked projections and the fused elementwise chain.

A layer is 4 GEMMs (q/k/v stacked, o, gate/up stacked, down) and 3 fused kernels (add_rms_norm,
qk_norm_rope_append, silu_mul) around its attention, rounding where the eager modules round. The
stacked weights share memory with the model's parameters (`stack_linears`), so loads, optimizer steps
and LoRA merges write through; `refresh` stacks again parameters whose data was replaced. peft's LoRA
adapters are added per stacked member as peft computes them; adapters it does not reproduce make
`usable()` False and the runner takes the model's modular forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparrow.kernels.ops import TORCH, TorchOps

from ...attention.paged import DecodeAttention
from ...model.llama import Transformer


def base_linear(module: nn.Module) -> nn.Module:
    """The nn.Linear that holds a projection's weight (peft wraps it as `base_layer`)."""
    return getattr(module, "base_layer", module)


@dataclass
class Stacked:
    """One product over the stacked weights of `members` (the model's modules, peft wrappers included):
    weight [sum(sizes), in] whose row blocks are the members' weight parameters, bias likewise or None."""

    members: tuple[nn.Module, ...]
    sizes: tuple[int, ...]
    weight: Tensor
    bias: Tensor | None

    def in_place(self) -> bool:
        """Whether every member's parameters still lie at their rows of the stack."""
        return (_at_rows(self.weight, [base_linear(m).weight for m in self.members])
                and (self.bias is None or _at_rows(self.bias, [base_linear(m).bias for m in self.members])))


def _at_rows(stack: Tensor, params: list[Tensor]) -> bool:
    """Whether `params` are consecutive row blocks of `stack`, in order, from its first row."""
    row = stack[0].numel() if stack.dim() == 2 else 1
    offset = stack.storage_offset()
    ptr = stack.untyped_storage().data_ptr()
    for p in params:
        if p is None or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset \
                or not p.is_contiguous() or p.dtype != stack.dtype:
            return False
        offset += p.shape[0] * row
    return offset == stack.storage_offset() + stack.numel()


def _stack_tensors(params: list[Tensor]) -> Tensor:
    """[sum(rows), ...]: the params' data moved into one storage, each param then a view of its rows.
    Params already so stacked (a model stacked before) are viewed as they are, without a copy."""
    first = params[0]
    shape = (sum(p.shape[0] for p in params),) + tuple(first.shape[1:])
    stride = (first[0].numel(),) + tuple(first.stride()[1:]) if first.dim() == 2 else (1,)
    total = shape[0] * (stride[0] if first.dim() == 2 else 1)
    if first.untyped_storage().nbytes() >= (first.storage_offset() + total) * first.element_size():
        view = first.detach().as_strided(shape, stride, first.storage_offset())
        if _at_rows(view, params):
            return view
    with torch.inference_mode(False), torch.no_grad():  # the new storage must stay usable by autograd
        stack = torch.empty(shape, dtype=first.dtype, device=first.device)
        row = 0
        for p in params:
            stack[row:row + p.shape[0]].copy_(p.detach())
            p.data = stack[row:row + p.shape[0]]
            row += p.shape[0]
    return stack


def stack_linears(members: tuple[nn.Module, ...]) -> Stacked | None:
    """The members' weights (and biases) stacked in place; None if they cannot share a product (not
    linear layers, different dtypes or devices, a bias on some but not all)."""
    linears = [base_linear(m) for m in members]
    if not all(isinstance(lin, nn.Linear) for lin in linears):
        return None
    weights = [lin.weight for lin in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 \
            or len({lin.bias is None for lin in linears}) != 1:
        return None
    weight = _stack_tensors(weights)
    bias = None if linears[0].bias is None else _stack_tensors([lin.bias for lin in linears])
    return Stacked(tuple(members), tuple(w.shape[0] for w in weights), weight, bias)


def lora_terms(module: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, float]] | None:
    """The active LoRA adapters of a projection as (lora_A, lora_B, dropout, scaling), [] for a plain
    linear (or adapters disabled or merged), None for adapters this module does not reproduce."""
    if not hasattr(module, "lora_A"):
        return []
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    terms = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(name) or name in getattr(module, "lora_variant", {}):
            return None
        terms.append((module.lora_A[name], module.lora_B[name], module.lora_dropout[name],
                      module.scaling[name]))
    return terms


class GpuDecode:
    """The decode step of a `Transformer` in its inference form (see the module docstring)."""

    def __init__(self, model: Transformer, ops: TorchOps = TORCH):
        self.model, self.ops = model, ops
        self.cfg = model.cfg
        self.qkv: list[Stacked | None] = []
        self.gate_up: list[Stacked | None] = []
        self.refresh()

    def refresh(self) -> bool:
        """Stack the projections again where a parameter was replaced (or not yet stacked); whether any
        was. Cheap when nothing changed: a few pointer comparisons per layer."""
        changed = False
        for i, block in enumerate(self.model.layers):
            for groups, members in ((self.qkv, (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)),
                                    (self.gate_up, (block.mlp.gate_proj, block.mlp.up_proj))):
                old = groups[i] if i < len(groups) else None
                if old is not None and old.members == members and old.in_place():
                    continue
                stacked = stack_linears(members)
                if i < len(groups):
                    groups[i] = stacked
                else:
                    groups.append(stacked)
                changed = True
        return changed

    def usable(self) -> bool:
        """Whether every layer's stacked products (with their adapters) reproduce the model's."""
        for group in (self.qkv, self.gate_up):
            for stacked in group:
                if stacked is None or any(lora_terms(m) is None for m in stacked.members):
                    return False
        return True

    def _product(self, stacked: Stacked, x: Tensor) -> Tensor:
        """x [B, in] -> [B, sum(sizes)]: the base product over the stack, then each member's adapters
        added to its columns as peft adds them (in the adapters' dtype, rounded back once)."""
        out = F.linear(x, stacked.weight, stacked.bias)
        col = 0
        for member, size in zip(stacked.members, stacked.sizes):
            terms = lora_terms(member)
            if terms:
                part = out[:, col:col + size]
                acc = part
                for lora_a, lora_b, dropout, scaling in terms:
                    acc = acc + lora_b(lora_a(dropout(x.to(lora_a.weight.dtype)))) * scaling
                part.copy_(acc.to(out.dtype))
            col += size
        return out

    def hidden(self, tokens: Tensor, positions: Tensor, attention: DecodeAttention) -> Tensor:
        """tokens, positions [B, 1] -> the final normed hidden states [B, hidden] of one decode step;
        the new keys and values go to the cache at `attention.batch.slots`."""
        model, ops, cfg = self.model, self.ops, self.cfg
        b = tokens.shape[0]
        pos = positions[:, 0]
        slots = attention.batch.slots
        layers = model.layers
        residual = model.embed_tokens(tokens[:, 0])  # [B, H], a fresh tensor: the residual stream
        h = ops.add_rms_norm(None, residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        mlp_out = None
        for i, block in enumerate(layers):
            if mlp_out is not None:
                norm = block.input_layernorm
                h = ops.add_rms_norm(mlp_out, residual, norm.weight, norm.eps)
            attn = block.attn
            qkv = self._product(self.qkv[i], h)  # [B, (Hq + 2 Hkv) D]
            k_pages, v_pages, centroids = attention.cache.layer(i)
            qn = attn.q_norm if cfg.qk_norm else None
            kn = attn.k_norm if cfg.qk_norm else None
            q = ops.qk_norm_rope_append(qkv, pos, slots, model.rope_cos, model.rope_sin,
                                        None if qn is None else qn.weight, None if kn is None else kn.weight,
                                        cfg.rms_norm_eps if qn is None else qn.eps, k_pages, v_pages,
                                        centroids, cfg.num_heads)  # [B, Hq, D]
            out = attn.o_proj(attention.attend(i, q).reshape(b, -1))
            norm = block.post_attention_layernorm
            h = ops.add_rms_norm(out, residual, norm.weight, norm.eps)
            mlp_out = block.mlp.down_proj(ops.silu_mul(self._product(self.gate_up[i], h)))
        return ops.add_rms_norm(mlp_out, residual, model.norm.weight, model.norm.eps)


def decode_hidden(form: GpuDecode | None, model: Transformer, tokens: Tensor, positions: Tensor,
                  attention: DecodeAttention, kv_len: int | None) -> Tensor:
    """One decode step's final hidden states [B, hidden]: the inference form where it reproduces the
    model (`form.usable()`), else the model's modular forward (`kv_len` as `hidden_states` takes it)."""
    if form is not None and form.usable():
        return form.hidden(tokens, positions, attention)
    return model.hidden_states(tokens, positions=positions, attention=attention, kv_len=kv_len)[:, 0]
