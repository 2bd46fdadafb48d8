"""The vocabulary side of the model: fp32 logits from 16-bit weights, and per-token quantities over the
full vocabulary computed in chunks of positions.

Why chunks: the logits of one 32K-token sequence over Qwen3's 152K vocabulary are 18.5 GiB in fp32, and
a log-softmax and its exp are as many again. Every per-token quantity the learner and the scorers need
(the sampled token's logprob, the entropy, the dense logprobs of a few other ids, alpha, a KL) is a
reduction over the vocabulary at one position, so it is computed `POSITION_CHUNK` positions at a time
from the [N, hidden] states and only the [N] (or [N, K]) results are kept. Under autograd each chunk
runs under `torch.utils.checkpoint` (non-reentrant): the forward keeps only the chunk's hidden states,
and the backward recomputes that chunk's logits, so the peak is one chunk's [chunk, V] tensors whatever
N is; the gradient is the unchunked one (each position's terms depend on its own row only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

POSITION_CHUNK = 1024  # positions per chunk: 1024 x 152K vocabulary x 4 B = 0.6 GiB per fp32 copy

_MM_FP32: dict[str, bool] = {}  # device type -> whether torch.mm(out_dtype=float32) runs there


class _Fp32Product(torch.autograd.Function):
    """hidden [M, H] @ weight [V, H]^T, 16-bit inputs, fp32 accumulation and fp32 output (no rounding of
    the product to 16 bits); the backward runs in the weight's dtype, as autocast's product would."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


def fp32_product(hidden: Tensor, weight: Tensor) -> Tensor:
    """hidden [..., H] (16-bit) @ weight [V, H]^T -> [..., V] fp32, the accumulator itself where the
    device's torch offers it (cuBLAS), else the product of the fp32 casts (the same numbers up to
    summation order, at the cost of an fp32 copy of the weight per call)."""
    device = weight.device.type
    if device not in _MM_FP32:
        try:
            probe = torch.ones(2, 2, dtype=weight.dtype, device=weight.device)
            _MM_FP32[device] = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_FP32[device] = False
    if not _MM_FP32[device] or hidden.dtype != weight.dtype:
        return torch.nn.functional.linear(hidden.float(), weight.float())
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _Fp32Product.apply(flat, weight).view(*hidden.shape[:-1], weight.shape[0])


def over_chunks(fn: Callable[..., tuple[Tensor, ...]], *rows: Tensor | None,
                chunk: int = POSITION_CHUNK) -> tuple[Tensor, ...]:
    """fn applied to chunks of `chunk` rows (dim 0 of every given tensor; None passes through), its
    outputs concatenated. With gradients recorded, each chunk runs under activation checkpointing."""
    n = next(r for r in rows if r is not None).shape[0]
    grad = torch.is_grad_enabled()
    parts: list[tuple[Tensor, ...]] = []
    for lo in range(0, max(n, 1), chunk):  # no rows: one call on the empty slices
        args = [None if r is None else r[lo:lo + chunk] for r in rows]
        out = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        parts.append(out if isinstance(out, tuple) else (out,))
    return tuple(p[0] if len(parts) == 1 else torch.cat(p) for p in zip(*parts))


@dataclass
class TokenScores:
    logp: Tensor  # [N] log p(target) at the temperature; differentiable when the hidden states are
    entropy: Tensor | None  # [N] entropy of the next-token distribution (no gradient)
    extra_logp: Tensor | None  # [N, K] logprobs of the extra ids (no gradient)


def token_scores(logits: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor,
                 temperature: float = 1.0, extra_ids: Tensor | None = None, entropy: bool = True,
                 chunk: int = POSITION_CHUNK) -> TokenScores:
    """Per position of hidden [N, H]: the logprob of targets [N], optionally the entropy and the logprobs
    of extra_ids [N, K], at `temperature` (<= 0 counts as 1), `logits` the model's fp32 head."""
    temp = temperature if temperature > 0 else 1.0

    def scores(h: Tensor, tgt: Tensor, extra: Tensor | None) -> tuple[Tensor, ...]:
        logp_all = torch.log_softmax(logits(h) / temp, dim=-1)  # [chunk, V]
        out = [logp_all.gather(-1, tgt[:, None]).squeeze(-1)]
        with torch.no_grad():
            if entropy:
                out.append(-(logp_all.exp() * logp_all).sum(-1))
            if extra is not None:
                out.append(logp_all.gather(-1, extra))
        return tuple(out)

    extra_ids = None if extra_ids is None else extra_ids.to(hidden.device).long()
    out = list(over_chunks(scores, hidden, targets.to(hidden.device), extra_ids, chunk=chunk))
    logp = out.pop(0)
    ent = out.pop(0) if entropy else None
    extra = out.pop(0) if extra_ids is not None else None
    return TokenScores(logp, ent, extra)
