"""The learner's view of a batch of rollouts: dense, teacher-forced logprobs of the sampled tokens.

Each sequence is its prompt followed by its completion; the logits after prefix token j predict token
j + 1, so completion token 0 is read off the prompt's last position and token i > 0 off completion
position i - 1. The K samples of a prompt share it, so the prompt runs through the decoder once per
distinct prompt and its keys/values are attended to by every completion of the group: the work over
prompts is P x N tokens instead of P x K x N, which is most of a GRPO batch when prompts are long.
With gradients enabled the gradient flows from every completion into the shared prompt pass (that is
what a LoRA on every layer needs). The result equals running each prompt + completion as one causal
sequence, up to float rounding. Logprobs and entropy use the sampling temperature, as the rollout's
logprobs do; the same forward also gives the dense logprobs of any extra token ids (the engine's top-k
sparse candidates), which the top-k lower bound of alpha needs. With gradients enabled this is the
forward of the policy loss; under no_grad it is the "old" (dense recompute) pass. Entropy is a metric,
never differentiated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mismatch import pad_right
from ..model.llama import AttentionContext, DenseAttention, Transformer


@dataclass
class CompletionScores:
    logp: Tensor  # [B, T] log p(token) of each completion token (0 at padding)
    entropy: Tensor  # [B, T] entropy of the dense next-token distribution (0 at padding), no grad
    mask: Tensor  # [B, T] bool, real completion tokens
    extra_logp: Tensor | None  # [B, T, K] dense logprobs of `extra_ids`, when given


def completion_mask(lengths: Sequence[int], device) -> Tensor:
    """[B, max length] bool: True at the first lengths[b] positions of row b."""
    lens = torch.as_tensor(list(lengths), device=device)
    return torch.arange(int(lens.max()), device=device)[None, :] < lens[:, None]


class RecordingAttention(DenseAttention):
    """Dense causal attention over whole sequences that keeps each layer's keys/values."""

    def __init__(self):
        self.kv: list[tuple[Tensor, Tensor]] = []

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        self.kv.append((k, v))
        return super().__call__(layer, q, k, v, ctx)


class PrefixAttention:
    """Completions attending to their group's prompt (recorded keys/values, first `prompt_len` valid)
    and causally to themselves."""

    def __init__(self, prefix: list[tuple[Tensor, Tensor]], group: Tensor, prompt_len: Tensor):
        self.prefix, self.group = prefix, group  # group [B]: row -> prompt index
        n = prefix[0][0].shape[2]  # longest prompt; prefix_mask [B, N] marks each row's real keys
        self.prefix_mask = torch.arange(n, device=group.device)[None, :] < prompt_len[group][:, None]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        pk, pv = (x.index_select(0, self.group) for x in self.prefix[layer])  # [B, Hkv, N, D]
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat([self.prefix_mask[:, None, :].expand(-1, t, -1),
                          causal[None].expand(q.shape[0], -1, -1)], dim=2)  # [B, T, N + T]
        return F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2),
                                              attn_mask=mask[:, None], enable_gqa=True)


def completion_hidden(model: Transformer, prompts: Sequence[Sequence[int]],
                      completions: Sequence[Sequence[int]]) -> Tensor:
    """[B, T, hidden]: the normed hidden state that predicts each completion token."""
    device = model.embed_tokens.weight.device
    distinct: dict[tuple[int, ...], int] = {}
    group = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=device)
    unique = list(distinct)
    prompt_len = torch.tensor([len(p) for p in unique], device=device)
    recorder = RecordingAttention()
    prompt_hidden = model.hidden_states(pad_right(unique, device), attention=recorder)  # [G, N, H]
    first = prompt_hidden[group, prompt_len[group] - 1][:, None]  # [B, 1, H] predicts token 0
    t = max(len(c) for c in completions)
    if t == 1:
        return first
    inputs = pad_right([c[:-1] for c in completions], device)  # [B, T-1]
    positions = prompt_len[group][:, None] + torch.arange(t - 1, device=device)[None, :]
    rest = model.hidden_states(inputs, positions=positions,
                               attention=PrefixAttention(recorder.kv, group, prompt_len))  # [B, T-1, H]
    return torch.cat([first, rest], dim=1)


def completion_logprobs(model: Transformer, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]], temperature: float = 1.0,
                        extra_ids: Tensor | None = None) -> CompletionScores:
    """Dense teacher-forced scores of `completions` [B][T_b] after `prompts` [B][N_b].

    `extra_ids` [B, T, K] (padded to the longest completion): token ids whose dense logprobs are also
    returned at each completion position. Temperature <= 0 counts as 1 (greedy rollouts report
    logprobs at T = 1)."""
    device = model.embed_tokens.weight.device
    mask = completion_mask([len(c) for c in completions], device)  # [B, T]
    hidden = completion_hidden(model, prompts, completions)
    logits = model.lm_head(hidden).float() / (temperature if temperature > 0 else 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    targets = pad_right(completions, device)  # [B, T]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    extra = None if extra_ids is None else logp_all.gather(-1, extra_ids.to(device).long())
    zero = torch.zeros((), device=device)
    return CompletionScores(torch.where(mask, logp, zero), torch.where(mask, entropy, zero), mask,
                            None if extra is None else torch.where(mask[..., None], extra, zero))
