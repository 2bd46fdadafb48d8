"""The learner's view of a batch of rollouts: dense, teacher-forced logprobs of the sampled tokens.

Every sequence is its prompt followed by its completion, right-padded into one [B, L] batch, and runs
through the decoder as whole sequences (causal SDPA, prefill-style: the learner is always dense). The
logits at position j predict token j + 1, so completion token i of a sequence whose prompt has n
tokens is read off position n - 1 + i. Logprobs and entropy use the sampling temperature, as the
rollout's logprobs do; the same forward also gives the dense logprobs of any extra token ids (the
engine's top-k sparse candidates), which is what the top-k lower bound of alpha needs. With gradients
enabled this is the forward of the policy loss; under no_grad it is the "old" (dense recompute) pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..generate import pad_right
from ..model.llama import Transformer


@dataclass
class CompletionScores:
    logp: Tensor  # [B, T] log p(token) of each completion token (0 at padding)
    entropy: Tensor  # [B, T] entropy of the dense next-token distribution (0 at padding)
    mask: Tensor  # [B, T] bool, real completion tokens
    extra_logp: Tensor | None  # [B, T, K] dense logprobs of `extra_ids`, when given


def completion_mask(lengths: Sequence[int], device) -> Tensor:
    """[B, max length] bool: True at the first lengths[b] positions of row b."""
    lens = torch.as_tensor(list(lengths), device=device)
    return torch.arange(int(lens.max()), device=device)[None, :] < lens[:, None]


def completion_logprobs(model: Transformer, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]], temperature: float = 1.0,
                        extra_ids: Tensor | None = None) -> CompletionScores:
    """Dense teacher-forced scores of `completions` [B][T_b] after `prompts` [B][N_b].

    `extra_ids` [B, T, K] (padded to the longest completion): token ids whose dense logprobs are also
    returned at each completion position. Temperature <= 0 counts as 1 (greedy rollouts report
    logprobs at T = 1)."""
    device = model.embed_tokens.weight.device
    tokens = pad_right([list(p) + list(c) for p, c in zip(prompts, completions)], device)  # [B, L]
    n = torch.tensor([len(p) for p in prompts], device=device)
    mask = completion_mask([len(c) for c in completions], device)  # [B, T]
    t = mask.shape[1]
    # positions n-1 .. n-2+T predict completion tokens 0 .. T-1; padded positions read a real row
    rows = (n[:, None] - 1 + torch.arange(t, device=device)[None, :]).clamp(max=tokens.shape[1] - 1)
    hidden = model.hidden_states(tokens)  # [B, L, H]
    hidden = torch.gather(hidden, 1, rows[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
    logits = model.lm_head(hidden).float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    targets = pad_right(completions, device)  # [B, T]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    extra = None if extra_ids is None else logp_all.gather(-1, extra_ids.to(device).long())
    zero = torch.zeros((), device=device)
    return CompletionScores(torch.where(mask, logp, zero), torch.where(mask, entropy, zero), mask,
                            None if extra is None else torch.where(mask[..., None], extra, zero))
