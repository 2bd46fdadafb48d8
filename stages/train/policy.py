"""The learner's view of a batch of rollouts: dense, teacher-forced logprobs of the sampled tokens, by a
shared prompt pass or plain causal rows per micro-batch (docs/training.md, design notes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.head import POSITION_CHUNK, token_scores
from ..model.llama import AttentionContext, DenseAttention, Transformer
from ..scoring.mismatch import pad_right

PREFIX_MASK_ELEMENTS = 1 << 26


@dataclass
class CompletionScores:
    logp: Tensor  # [B, T] log p(token) of each completion token (0 at padding)
    entropy: Tensor | None  # [B, T] entropy of the dense next-token distribution (0 at padding), no grad
    mask: Tensor  # [B, T] bool, real completion tokens
    extra_logp: Tensor | None  # [B, T, K] dense logprobs of `extra_ids`, when given


def completion_mask(lengths: Sequence[int], device) -> Tensor:
    """[B, max length] bool: True at the first lengths[b] positions of row b."""
    lens = torch.as_tensor(list(lengths), device=device)
    return torch.arange(int(lens.max()), device=device)[None, :] < lens[:, None]


class RecordingAttention(DenseAttention):
    """Dense causal attention over whole sequences that keeps each layer's keys/values (by layer, so a
    layer recomputed under activation checkpointing overwrites its own entry)."""

    def __init__(self):
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        self.kv[layer] = (k, v)
        return super().__call__(layer, q, k, v, ctx)


class PrefixAttention:
    """Completions attending to their group's prompt (recorded keys/values, first `prompt_len` valid)
    and causally to themselves; the [B, 1, T, N + T] mask is built once for every layer."""

    def __init__(self, prefix: dict[int, tuple[Tensor, Tensor]], group: Tensor, prompt_len: Tensor, t: int):
        self.prefix, self.group = prefix, group  # group [B]: row -> prompt index
        n = prefix[0][0].shape[2]  # longest prompt; prefix_mask [B, N] marks each row's real keys
        prefix_mask = torch.arange(n, device=group.device)[None, :] < prompt_len[group][:, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=group.device).tril()
        self.mask = torch.cat([prefix_mask[:, None, :].expand(-1, t, -1),
                               causal[None].expand(len(group), -1, -1)], dim=2)[:, None]  # [B, 1, T, N + T]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        pk, pv = (x.index_select(0, self.group) for x in self.prefix[layer])  # [B, Hkv, N, D]
        return F.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2),
                                              attn_mask=self.mask, enable_gqa=True)


def shares_prompts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> bool:
    """The memory rule of the module docstring: the shared-prompt pass, or plain causal sequences."""
    distinct = len({tuple(p) for p in prompts})
    if distinct == len(prompts):
        return False
    t = max(len(c) for c in completions)
    return len(prompts) * t * (max(len(p) for p in prompts) + t) <= PREFIX_MASK_ELEMENTS


def completion_hidden(model: Transformer, prompts: Sequence[Sequence[int]],
                      completions: Sequence[Sequence[int]], shared: bool | None = None) -> Tensor:
    """[B, T, hidden]: the normed hidden state that predicts each completion token; `shared` forces
    one form of the forward (default: the memory rule)."""
    if shared is None:
        shared = shares_prompts(prompts, completions)
    if shared:
        return _shared_prompt_hidden(model, prompts, completions)
    return _causal_hidden(model, prompts, completions)


def _causal_hidden(model: Transformer, prompts: Sequence[Sequence[int]],
                   completions: Sequence[Sequence[int]]) -> Tensor:
    """Each prompt + completion (its last token dropped) as one right-padded causal sequence."""
    device = model.embed_tokens.weight.device
    rows = [list(p) + list(c[:-1]) for p, c in zip(prompts, completions)]
    hidden = model.hidden_states(pad_right(rows, device))  # [B, S, H]
    t = max(len(c) for c in completions)
    start = torch.tensor([len(p) - 1 for p in prompts], device=device)  # predicts completion token 0
    index = (start[:, None] + torch.arange(t, device=device)[None, :]).clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[2]))  # [B, T, H]


def _shared_prompt_hidden(model: Transformer, prompts: Sequence[Sequence[int]],
                          completions: Sequence[Sequence[int]]) -> Tensor:
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
    attention = PrefixAttention(recorder.kv, group, prompt_len, t - 1)
    rest = model.hidden_states(inputs, positions=positions, attention=attention)  # [B, T-1, H]
    return torch.cat([first, rest], dim=1)


def completion_logprobs(model: Transformer, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]], temperature: float = 1.0,
                        extra_ids: Tensor | None = None, entropy: bool = True,
                        chunk: int = POSITION_CHUNK, shared: bool | None = None) -> CompletionScores:
    """Dense teacher-forced scores of `completions` [B][T_b] after `prompts` [B][N_b].

    `extra_ids` [B, T, K] (padded to the longest completion): token ids whose dense logprobs are also
    returned at each completion position. Temperature <= 0 counts as 1 (greedy rollouts report
    logprobs at T = 1). `entropy=False` skips the entropy (the update needs only the logprobs);
    `chunk`: positions per vocabulary-sized chunk; `shared`: see `completion_hidden`."""
    device = model.embed_tokens.weight.device
    mask = completion_mask([len(c) for c in completions], device)  # [B, T]
    hidden = completion_hidden(model, prompts, completions, shared)
    rows, cols = mask.nonzero(as_tuple=True)  # the real completion positions
    targets = pad_right(completions, device)[rows, cols]
    extra = None if extra_ids is None else extra_ids.to(device)[rows, cols]
    scores = token_scores(model.logits, hidden[rows, cols], targets, temperature, extra, entropy, chunk)

    def scatter(values: Tensor) -> Tensor:  # [M, ...] at the real positions -> [B, T, ...], 0 elsewhere
        out = values.new_zeros((*mask.shape, *values.shape[1:]))
        return out.index_put((rows, cols), values)

    return CompletionScores(scatter(scores.logp), None if scores.entropy is None else scatter(scores.entropy),
                            mask, None if scores.extra_logp is None else scatter(scores.extra_logp))
