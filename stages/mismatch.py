"""Per-token sparse-to-dense mismatch by teacher forcing, and the samplers that produce the tokens.

A sequence is scored by one dense forward pass and one sparse forward pass per budget over the whole
sequence; in the sparse pass every generated position selects its own pages (see
`attention.SparseAttention`), which reproduces incremental sparse decoding exactly. The
vocabulary-sized work (softmax, alpha, entropy) runs over chunks of positions so memory stays
bounded for 8K-token sequences. Alpha and the logprobs use the sampling temperature (1 for greedy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE, SparseAttention
from .generate import Generation, generate
from .model.llama import Attention, Transformer
from .schedule import Schedule

BudgetFn = Callable[[int], int]  # cache length at which a token is produced -> budget (0 = dense)


def decode_budgets(positions: Tensor, prompt_lens: Tensor, budget_at: BudgetFn | None) -> Tensor:
    """Budget of each query: 0 for prompt (prefill) queries, budget_at(position + 1) for decode."""
    if budget_at is None:
        return torch.zeros_like(positions)
    table = torch.tensor([budget_at(n) for n in range(int(positions.max()) + 2)],
                         device=positions.device)
    return torch.where(positions >= prompt_lens[:, None], table[positions + 1], 0)


def sparse_step_attention(budget_at: BudgetFn, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                          page: int = PAGE_SIZE) -> Callable[[Tensor], Attention]:
    """For the generator: the attention of a decode step whose queries sit at `lengths`."""
    def pick(lengths: Tensor) -> Attention:
        budgets = torch.tensor([budget_at(int(n) + 1) for n in lengths], device=lengths.device)
        return SparseAttention(budgets, dense_layers, page)
    return pick


def make_budget_fn(sampler: str | Schedule | int | None) -> BudgetFn | None:
    """'dense' | 'budget:B' | a Schedule | an int budget -> budget function (None = dense)."""
    if sampler is None or sampler == "dense" or sampler == 0:
        return None
    if isinstance(sampler, Schedule):
        return sampler.budget_at
    budget = int(sampler.split(":", 1)[1]) if isinstance(sampler, str) else int(sampler)
    return lambda _: budget


def sample(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           temperature: float, top_p: float, seed: int, budget_at: BudgetFn | None,
           eos_ids: Sequence[int] = (), dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
           page: int = PAGE_SIZE, on_step=None) -> list[Generation]:
    step_attention = sparse_step_attention(budget_at, dense_layers, page) if budget_at else None
    return generate(model, prompts, max_new_tokens, temperature, top_p, seed, eos_ids,
                    attention_for_step=step_attention, on_step=on_step)


@dataclass
class ScoredTokens:
    """Columns for the generated tokens of a batch of sequences (row order: sequence, then token)."""

    seq: np.ndarray  # index of the sequence in the batch
    position: np.ndarray  # cache length when the token was produced
    token_id: np.ndarray
    logp_dense: np.ndarray
    entropy_dense: np.ndarray
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]  # budget -> (alpha, logp_sparse)


@torch.inference_mode()
def score_sequences(model: Transformer, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], budgets: Sequence[int | BudgetFn],
                    temperature: float = 1.0, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                    page: int = PAGE_SIZE, vocab_chunk: int = 1024) -> ScoredTokens:
    """Teacher-forced dense and sparse scoring of every completion token."""
    device = model.embed_tokens.weight.device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    b, t_max = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(b, t_max, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.as_tensor(s, device=device)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
    positions = torch.arange(t_max, device=device).expand(b, t_max)
    # hidden index i predicts token i + 1; generated token j of sequence s sits at index len(p) + j
    rows = [(i, len(p) - 1 + j) for i, (p, c) in enumerate(zip(prompts, completions))
            for j in range(len(c))]
    seq_idx = torch.tensor([r[0] for r in rows], dtype=torch.long, device=device)
    hid_idx = torch.tensor([r[1] for r in rows], dtype=torch.long, device=device)
    targets = tokens[seq_idx, hid_idx + 1]
    temp = temperature if temperature > 0 else 1.0

    def logprobs(hidden: Tensor, lo: int, hi: int) -> Tensor:
        h = hidden[seq_idx[lo:hi], hid_idx[lo:hi]]
        return torch.log_softmax(model.lm_head(h).float() / temp, dim=-1)  # [n, V]

    dense_h = model.hidden_states(tokens, positions=positions)
    sparse_h = {}
    for budget in budgets:
        budget_at = budget if callable(budget) else (lambda _, b_=int(budget): b_)
        q_budgets = decode_budgets(positions, prompt_lens, budget_at)
        attention = SparseAttention(q_budgets, dense_layers, page)
        sparse_h[budget] = model.hidden_states(tokens, positions=positions, attention=attention)

    n = len(rows)
    logp_dense = torch.empty(n)
    entropy = torch.empty(n)
    sparse = {k: (torch.empty(n), torch.empty(n)) for k in sparse_h}
    for lo in range(0, n, vocab_chunk):
        hi = min(n, lo + vocab_chunk)
        ld = logprobs(dense_h, lo, hi)
        pd = ld.exp()
        tgt = targets[lo:hi, None]
        logp_dense[lo:hi] = ld.gather(-1, tgt).squeeze(-1).cpu()
        entropy[lo:hi] = -(pd * ld).sum(-1).clamp_min(0).cpu()
        for k, h in sparse_h.items():
            ls = logprobs(h, lo, hi)
            sparse[k][0][lo:hi] = torch.minimum(pd, ls.exp()).sum(-1).clamp(0, 1).cpu()
            sparse[k][1][lo:hi] = ls.gather(-1, tgt).squeeze(-1).cpu()
    return ScoredTokens(
        seq=seq_idx.cpu().numpy(), position=(hid_idx + 1).cpu().numpy(),
        token_id=targets.cpu().numpy(), logp_dense=logp_dense.numpy(),
        entropy_dense=entropy.numpy(),
        sparse={k: (a.numpy(), lp.numpy()) for k, (a, lp) in sparse.items()},
    )
