"""Reference generator: batched, KV-cached, plain torch. Correctness first, not speed. A test oracle.

Every stage samples through the rollout engine (`stages.engine`); this loop stays as the independent
reference the engine and teacher-forced scoring are tested against (`sample` is the sparse sampler of
tests/test_mismatch.py). Its trajectories depend on how sequences are batched (one generator per
batch), the engine's do not.

Sequences of different prompt lengths share one batch: prompts are right-padded, every sequence
writes its tokens to its own cache slots (slot = position), and padded slots are overwritten by the
sequence's later tokens before anything reads them. Attention is chosen per decode step by the
caller-provided `attention_for_step`, so dense, fixed-budget and scheduled sparse sampling all go
through this one loop. Returned logprobs are those of the sampled token under the distribution at
the sampling temperature (temperature 0, greedy, reports temperature 1), before top-p truncation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..attention import DEFAULT_DENSE_LAYERS, PAGE_SIZE, SparseAttention
from ..engine.sequence import SamplingParams
from ..kv_policies import BudgetFn
from ..model.llama import Attention, DenseAttention, KVCache, Transformer
from .mismatch import pad_right

__all__ = ["Generation", "generate", "sample", "sample_next", "sparse_step_attention"]


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def sample_next(logits: Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits [B, V] -> (token [B], logprob of that token at the sampling temperature [B])."""
    logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    if temperature <= 0:
        token = logits.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


@torch.inference_mode()
def generate(model: Transformer, prompts: Sequence[Sequence[int]], params: SamplingParams,
             eos_ids: Sequence[int] = (), attention_for_step: Callable[[Tensor], Attention] | None = None,
             on_step: Callable[[int], None] | None = None) -> list[Generation]:
    """Sample continuations of token-id prompts (`params`: max_new_tokens, temperature, top_p, seed and
    ignore_eos are read). `attention_for_step(lengths [B]) -> Attention` picks the attention of each
    decode step from the cache lengths before it (prefill is dense)."""
    max_new_tokens, temperature, top_p = params.max_new_tokens, params.temperature, params.top_p
    device = model.embed_tokens.weight.device
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    if int(lens.min()) < 1:
        raise ValueError("every prompt needs at least one token")
    cache = KVCache.allocate(model.cfg, b, int(lens.max()) + max_new_tokens,
                             model.embed_tokens.weight.dtype, device)
    gen = torch.Generator(device=device).manual_seed(params.seed)
    padded = pad_right(prompts, device)
    logits = model(padded, cache, attention=DenseAttention())  # [B, T, V]
    cache.lengths = lens.clone()
    last = logits[torch.arange(b, device=device), lens - 1]  # [B, V]
    outs = [Generation(prompt_len=len(p)) for p in prompts]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    for step in range(max_new_tokens):
        token, logp = sample_next(last, temperature, top_p, gen)
        for i in (~done).nonzero().flatten().tolist():
            outs[i].tokens.append(int(token[i]))
            outs[i].logprobs.append(float(logp[i]))
        if not params.ignore_eos:
            hit = torch.isin(token, eos) & ~done
            for i in hit.nonzero().flatten().tolist():
                outs[i].finish_reason = "stop"
            done |= hit
        if on_step is not None:
            on_step(step)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attention = attention_for_step(cache.lengths) if attention_for_step else DenseAttention()
        last = model(token[:, None], cache, attention=attention)[:, -1]
        cache.lengths = cache.lengths + 1
    return outs


def sparse_step_attention(budget_at: BudgetFn, dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS,
                          page: int = PAGE_SIZE) -> Callable[[Tensor], Attention]:
    """For the generator: the attention of a decode step whose queries sit at `lengths`."""
    def pick(lengths: Tensor) -> Attention:
        budgets = torch.tensor([budget_at(int(n) + 1) for n in lengths], device=lengths.device)
        return SparseAttention(budgets, dense_layers, page)
    return pick


def sample(model: Transformer, prompts: Sequence[Sequence[int]], params: SamplingParams,
           budget_at: BudgetFn | None, eos_ids: Sequence[int] = (),
           dense_layers: Sequence[int] = DEFAULT_DENSE_LAYERS, page: int = PAGE_SIZE) -> list[Generation]:
    """`generate` with the sparse attention of `budget_at` at every decode step (None: dense)."""
    step_attention = sparse_step_attention(budget_at, dense_layers, page) if budget_at else None
    return generate(model, prompts, params, eos_ids, attention_for_step=step_attention)
