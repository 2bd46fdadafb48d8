"""Per-token sparse-to-dense mismatch by teacher forcing.

A batch of sequences is scored by one dense prefill of the prompts (prefill is dense in every mode),
then one pass over the completions per attention mode (dense, and each budget) on top of the shared
prompt KV; in a sparse pass every generated position selects its own pages from its own prefix (see
`attention.SparseAttention`; on CUDA the engine's selection kernels, every position selecting as a
decode query of its own, and the block-sparse prefill kernel), which reproduces incremental sparse
decoding exactly. An eviction policy (SnapKV, R-KV) is replayed instead (stages/attention/eviction_replay.py:
the generated tokens between two compressions in one forward over the retained cache, compressing where
decoding compressed), each prompt length's sequences together, on a prompt prefilled again for it. Only
the final hidden states of each mode are kept ([tokens, hidden] per mode); the vocabulary-sized work
(the fp32 head, softmax, alpha, entropy) runs over chunks of `vocab_chunk` positions, so no [T, V]
tensor exists and a 32K-token sequence of a 152K vocabulary holds a few [1024, V] fp32 tensors at a
time. The attention masks of the completion passes are bounded the same way (`llama.masked_attention`,
`SparseAttention`'s query chunks). Alpha and the logprobs use the sampling temperature (1 for greedy).
The tokens come from elsewhere: the rollout engine (`stages.rollout`) or any other sampler; the
reference generator `stages.generate` is a test oracle only.

With an `actor` LoRA (DistillSparse, `stages.distill`), the sparse actor is the model with the LoRA
merged into every adapted linear layer for its whole forward, prefill included, exactly as the rollout
engine runs it: the dense pass uses the model's own weights, then the prompt is prefilled again with the
LoRA merged and the sparse passes run on top of that KV. The weights are merged outside inference mode
and restored bit for bit afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE, SparseAttention
from ..attention.eviction_replay import replay
from ..kv_policies import BlockTopK, BudgetFn, Eviction, KVPolicy
from ..model.bf16_products import fp32_products
from ..model.head import POSITION_CHUNK
from ..model.llama import Attention, KVCache, Transformer
from ..model.lora import LoraWeights, lora_merged

Mode = int | BudgetFn | KVPolicy  # a sparse mode to score: block top-k at a budget (function), or a policy

# the torch path's query chunks in the sparse passes: [B, Hq, chunk, S] masks of at most 32 Mi elements on
# a CPU, 256 Mi on CUDA without triton (the paged path bounds its page scores itself)
SPARSE_CHUNK_ELEMENTS = {False: 1 << 25, True: 1 << 28}


def decode_budgets(positions: Tensor, prompt_lens: Tensor, budget_at: BudgetFn | None) -> Tensor:
    """Budget of each query: 0 for prompt (prefill) queries, budget_at(position + 1) for decode."""
    if budget_at is None:
        return torch.zeros_like(positions)
    table = torch.tensor([budget_at(n) for n in range(int(positions.max()) + 2)],
                         device=positions.device)
    return torch.where(positions >= prompt_lens[:, None], table[positions + 1], 0)


def mode_policy(mode: Mode) -> KVPolicy:
    """The KV policy of a scoring mode (an int or a callable is block top-k at that budget)."""
    if isinstance(mode, KVPolicy):
        return mode
    if callable(mode):
        return BlockTopK(mode)
    return BlockTopK(lambda _, b=int(mode): b, f"budget:{int(mode)}")


def pad_right(rows: Sequence[Sequence[int]], device) -> Tensor:
    """Token-id rows -> [B, max len] long tensor, right-padded with 0."""
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), device=device)
    return out


@dataclass
class ScoredTokens:
    """Columns for the generated tokens of a batch of sequences (row order: sequence, then token)."""

    seq: np.ndarray  # index of the sequence in the batch
    position: np.ndarray  # cache length when the token was produced
    token_id: np.ndarray
    logp_dense: np.ndarray
    entropy_dense: np.ndarray
    sparse: dict[Mode, tuple[np.ndarray, np.ndarray]]  # mode as given -> (alpha, logp_sparse)
    # mode -> alpha of a speculative draft at the mode's budget, over the dense KV (`drafts=True`)
    draft: dict[Mode, np.ndarray] = field(default_factory=dict)


def score_sequences(model: Transformer, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], budgets: Sequence[Mode],
                    temperature: float = 1.0, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                    page: int = PAGE_SIZE, vocab_chunk: int = POSITION_CHUNK,
                    actor: LoraWeights | None = None, drafts: bool = False) -> ScoredTokens:
    """Teacher-forced dense and sparse scoring of every completion token.

    The prompt is prefilled once, densely, into a KV cache (prefill is dense in every mode); the
    completions then run as one chunk per attention mode on top of it, each query selecting its own
    pages. Every mode rewrites the same completion slots, so the prompt's KV is shared by all. With an
    `actor` LoRA the sparse modes run with it merged, on a prompt KV prefilled again with it.

    `drafts`: also the alpha of a speculative draft at each block top-k mode, whose queries select and
    attend over the dense pass's keys and values (a cycle's drafts read the dense KV that verification
    keeps, not a lossy sampler's own), run before any mode rewrites the completion slots."""
    device = model.embed_tokens.weight.device
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    if len(prompts) > 1 and longest >= model.cfg.max_position_embeddings:
        # no room for the padding slot below: score one sequence at a time (no padding needed)
        parts = [score_sequences(model, [p], [c], budgets, temperature, dense_layers, page,
                                 vocab_chunk, actor, drafts) for p, c in zip(prompts, completions)]
        return _concat(parts)
    b = len(prompts)
    n = torch.tensor([len(p) for p in prompts], device=device)  # prompt lengths
    g = torch.tensor([len(c) for c in completions], device=device)
    if int(g.min()) < 1:
        raise ValueError("every completion needs at least one token")
    prompt_tok = pad_right(prompts, device)  # [B, Nmax]
    gen_tok = pad_right(completions, device)  # [B, Gmax]
    scratch = int((n + g).max())  # padded completion tokens all go to this slot, after every real one
    if actor is not None and "lm_head" in actor.modules:
        raise ValueError("the sparse actor's LoRA adapts lm_head, which teacher-forced scoring does not "
                         "support")
    cache = KVCache.allocate(model.cfg, b, scratch + 1, model.embed_tokens.weight.dtype, device)
    steps = torch.arange(gen_tok.shape[1], device=device)
    gen_pos = torch.where(steps < g[:, None], n[:, None] + steps, scratch)  # [B, Gmax]

    def prefill() -> Tensor:
        """Dense prefill of the prompts into `cache`; [B, H]: the state that predicts token 0."""
        h = model.hidden_states(prompt_tok, cache, positions=_arange(b, prompt_tok.shape[1], 0, device))
        return h[torch.arange(b, device=device), n - 1]

    def completion_hidden(last_prompt_h: Tensor, attention: Attention | None) -> Tensor:
        """[B, Gmax, H]: row j predicts completion token j (0 from the prompt's last position)."""
        h = model.hidden_states(gen_tok, cache, positions=gen_pos, attention=attention)
        return torch.cat([last_prompt_h[:, None], h[:, :-1]], dim=1)

    with fp32_products(model), torch.inference_mode():
        last_prompt_h = prefill()
        hidden = {None: completion_hidden(last_prompt_h, None)}
        if drafts and actor is not None:
            raise ValueError("draft alpha is scored with the model's own weights, not a sparse actor's LoRA")
        drafted = {mode: completion_hidden(last_prompt_h, SparseAttention(
            decode_budgets(gen_pos, n, mode_policy(mode).read_budget), dense_layers, page,
            chunk_elements=SPARSE_CHUNK_ELEMENTS[device.type == "cuda"], over_cached=True))
            for mode in budgets if drafts and not mode_policy(mode).evicts}
    with lora_merged(model, actor), fp32_products(model), torch.inference_mode():
        if actor is not None:
            last_prompt_h = prefill()  # the actor's own prompt KV (prefill runs with its LoRA too)
        for mode in budgets:
            policy = mode_policy(mode)
            if policy.evicts:
                hidden[mode] = evicted_hidden(model, prompts, gen_tok, g, policy)
                continue
            attention = SparseAttention(decode_budgets(gen_pos, n, policy.read_budget), dense_layers, page,
                                        chunk_elements=SPARSE_CHUNK_ELEMENTS[device.type == "cuda"])
            hidden[mode] = completion_hidden(last_prompt_h, attention)
    return _score_hidden(model, hidden, gen_tok, g, n, budgets, temperature, vocab_chunk, drafted)


def evicted_hidden(model: Transformer, prompts: Sequence[Sequence[int]], gen_tok: Tensor, g: Tensor,
                   policy: Eviction) -> Tensor:
    """[B, Gmax, H]: row j predicts completion token j under `policy`'s eviction, replayed
    (stages/attention/eviction_replay.py) for the sequences of each prompt length together."""
    b, width = gen_tok.shape
    out = None
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for rows in by_length.values():
        longest = int(g[rows].max())
        prompt_tok = torch.tensor([list(prompts[i]) for i in rows], device=gen_tok.device)
        result = replay(model, prompt_tok, gen_tok[rows, : longest - 1], policy)
        if out is None:
            out = result.last_prompt.new_zeros(b, width, result.last_prompt.shape[-1])
        out[rows, 0] = result.last_prompt
        out[rows, 1:longest] = result.hidden
    return out


@torch.inference_mode()
def _score_hidden(model: Transformer, hidden: dict, gen_tok: Tensor, g: Tensor, n: Tensor,
                  budgets: Sequence[Mode], temperature: float, vocab_chunk: int,
                  drafted: dict | None = None) -> ScoredTokens:
    """Alpha, logprobs and entropy from the hidden states of each mode (None = dense); `drafted`: the
    drafts' hidden states by mode, for their alpha."""
    drafted = drafted or {}
    device = gen_tok.device
    valid = torch.arange(gen_tok.shape[1], device=device)[None, :] < g[:, None]
    seq_idx, tok_idx = valid.nonzero(as_tuple=True)  # row order: sequence, then token
    targets = gen_tok[seq_idx, tok_idx]
    temp = temperature if temperature > 0 else 1.0
    rows = len(targets)
    logp_dense, entropy = torch.empty(rows), torch.empty(rows)
    sparse = {k: (torch.empty(rows), torch.empty(rows)) for k in budgets}
    draft = {k: torch.empty(rows) for k in drafted}
    for lo in range(0, rows, vocab_chunk):
        sl = slice(lo, min(rows, lo + vocab_chunk))
        tgt = targets[sl, None]

        def logprobs(h: Tensor, sl: slice = sl) -> Tensor:
            return torch.log_softmax(model.logits(h[seq_idx[sl], tok_idx[sl]]) / temp, -1)

        ld = logprobs(hidden[None])
        pd = ld.exp()
        logp_dense[sl] = ld.gather(-1, tgt).squeeze(-1).cpu()
        entropy[sl] = (-(pd * ld).sum(-1)).clamp_min(0).cpu()
        for k in budgets:
            ls = logprobs(hidden[k])
            sparse[k][0][sl] = torch.minimum(pd, ls.exp()).sum(-1).clamp(0, 1).cpu()
            sparse[k][1][sl] = ls.gather(-1, tgt).squeeze(-1).cpu()
        for k in drafted:
            draft[k][sl] = torch.minimum(pd, logprobs(drafted[k]).exp()).sum(-1).clamp(0, 1).cpu()
    return ScoredTokens(
        seq=seq_idx.cpu().numpy(), position=(n[seq_idx] + tok_idx).cpu().numpy(),
        token_id=targets.cpu().numpy(), logp_dense=logp_dense.numpy(),
        entropy_dense=entropy.numpy(),
        sparse={k: (a.numpy(), lp.numpy()) for k, (a, lp) in sparse.items()},
        draft={k: a.numpy() for k, a in draft.items()},
    )


def _concat(parts: list[ScoredTokens]) -> ScoredTokens:
    offsets = np.cumsum([0] + [int(p.seq.max()) + 1 for p in parts[:-1]])
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])
    return ScoredTokens(
        seq=np.concatenate([p.seq + o for p, o in zip(parts, offsets)]), position=cat("position"),
        token_id=cat("token_id"), logp_dense=cat("logp_dense"), entropy_dense=cat("entropy_dense"),
        sparse={k: (np.concatenate([p.sparse[k][0] for p in parts]),
                    np.concatenate([p.sparse[k][1] for p in parts])) for k in parts[0].sparse},
        draft={k: np.concatenate([p.draft[k] for p in parts]) for k in parts[0].draft},
    )


def _arange(b: int, t: int, start: int, device) -> Tensor:
    return (start + torch.arange(t, device=device)).expand(b, t)
