"""Exact speculative decoding with the sparse actor as the draft model (`EngineConfig.speculate = K`).

A cycle drafts up to K tokens per running sample with the sample's own KV policy (plain decode steps at its
budget, each writing the fed token's keys), then one dense forward per sample over the K+1 fed positions
(its last token and the drafts) rewrites their keys and values densely and gives the dense distributions.
Draft j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the next token is drawn
from normalize(max(0, p_j - q_j)), and when every draft is kept a bonus token comes from the last dense
row. So the emitted tokens are distributed exactly as dense sampling's (speculative sampling, Leviathan et
al. 2023, Chen et al. 2023); temperature, top-k and top-p shape p and q alike before the rule, and a greedy
row keeps a draft iff it is the dense argmax. The reported logprobs are the dense model's.

The cache is then rolled back to the kept positions: pages past them go back to the pool and the partly
kept page's centroid is recomputed from the slots that stay. Every draw uses the sample's own generator,
so a seed gives the same rollouts whatever the batch. What a mean acceptance predicts per cycle:
stages/speculative_plan.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .block_manager import BlockManager
from .runner import ModelRunner
from .sampler import truncate
from .sequence import SamplingParams, Sequence


def sampling_probs(logits: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """logits [n, V] -> the distributions the rows draw from [n, V] float32: softmax(logits / T) truncated
    by top-k then top-p and renormalised; a greedy row is one-hot at its argmax."""
    logits = logits.float()
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
    probs = truncate(torch.softmax(logits / temps.to(logits.device), dim=-1), params)
    probs = probs / probs.sum(-1, keepdim=True)
    for i, p in enumerate(params):
        if p.temperature <= 0:
            probs[i] = torch.nn.functional.one_hot(logits[i].argmax(), logits.shape[-1]).float()
    return probs


def reported_logprobs(logits: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """The engine's logprob convention: log_softmax(logits / T) before truncation (T = 1 when greedy)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
    return torch.log_softmax(logits.float() / temps.to(logits.device), dim=-1)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution [V] by an exponential race, argmax p / E with E ~ Exp(1) (exact, and
    one uniform pass instead of multinomial's cumulative sum); without a generator (greedy) its argmax."""
    if generator is None:
        return int(probs.argmax())
    noise = torch.empty_like(probs).uniform_(generator=generator).log_().neg_()
    return int((probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax())


def accept_or_resample(p: Tensor, q: Tensor, drafts: Seq[int], generator: torch.Generator | None,
                       ) -> tuple[int, int]:
    """The rule. p [k+1, V] dense distributions at the k+1 fed positions, q [k, V] the distributions the k
    drafts were drawn from -> (drafts kept, the token that follows them)."""
    for j, d in enumerate(drafts):
        if generator is None:
            keep = bool(p[j, d] > 0)  # one-hot rows: the draft is the dense argmax
        else:
            u = float(torch.rand((), generator=generator))
            keep = u * float(q[j, d]) < float(p[j, d])
        if not keep:
            residual = (p[j] - q[j]).clamp_(min=0.0)
            total = float(residual.sum())
            return j, draw(residual / total if total > 0 else p[j], generator)
    return len(drafts), draw(p[len(drafts)], generator)


@dataclass
class Drafting:
    """One sample's cycle: where it started, how many drafts it may make, what it drew from."""

    seq: Sequence
    cached: int  # its cache length before the cycle (the slot of its last token, fed first)
    generated: int  # its generated tokens before the cycle
    limit: int  # drafts it may make (fewer near max_new_tokens)
    drafts: list[int] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)  # [V] each: the q each draft was drawn from

    @property
    def open(self) -> bool:
        eos = self.seq.request.eos_ids
        return len(self.drafts) < self.limit and not (self.drafts and self.drafts[-1] in eos)


@dataclass
class Emitted:
    """What a cycle gives one sample: its tokens (kept drafts, then the resampled or bonus token), their
    dense logprobs, top logprobs rows (or None) and the KV tokens each token's query read."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]
    tops: list[tuple[Tensor, Tensor] | None]
    kv_lens: list[int]
    kept: int  # of the drafts
    drafted: int


@dataclass
class Cycle:
    emitted: list[Emitted]  # per running sample, in batch order
    verify_seconds: float  # the dense verification forward, the device synchronized


def draft_limit(seq: Sequence, k: int) -> int:
    """Drafts a sample may make: k, fewer when fewer than k + 1 tokens remain of its max_new_tokens."""
    return max(0, min(k, seq.request.params.max_new_tokens - len(seq.tokens) - 1))


def run_cycle(runner: ModelRunner, blocks: BlockManager, seqs: list[Sequence], k: int) -> Cycle:
    """One speculative cycle of the running samples (each has the pages its k + 1 slots need)."""
    cycles = [Drafting(s, s.cached, len(s.tokens), draft_limit(s, k)) for s in seqs]
    _draft(runner, cycles)
    runner.synchronize()
    t0 = time.perf_counter()
    dense = runner.verify(seqs, [c.cached for c in cycles])
    runner.synchronize()
    verified = time.perf_counter() - t0
    out = [_decide(c, logits) for c, logits in zip(cycles, dense)]
    for c, e in zip(cycles, out):
        _roll_back(runner, blocks, c, e)
    return Cycle(out, verified)


def _draft(runner: ModelRunner, cycles: list[Drafting]) -> None:
    """Plain decode steps of the samples still drafting, each at its policy's budget."""
    while active := [c for c in cycles if c.open]:
        seqs = [c.seq for c in active]
        logits = runner.decode(seqs, [s.budget_now() for s in seqs])
        probs = sampling_probs(logits, [s.request.params for s in seqs])
        for c, q in zip(active, probs):
            token = draw(q, c.seq.generator)
            c.drafts.append(token)
            c.probs.append(q)
            c.seq.tokens.append(token)  # fed by the next draft step, then taken back
            c.seq.cached += 1


def _decide(c: Drafting, logits: Tensor) -> Emitted:
    """The rule over one sample's dense logits [fed tokens, V]: its drafts taken back off its tokens, the
    kept ones and the next token emitted with the dense model's logprobs."""
    s = c.seq
    del s.tokens[c.generated:]
    params = [s.request.params] * logits.shape[0]
    p = sampling_probs(logits, params)
    q = torch.stack(c.probs) if c.probs else p[:0]
    kept, nxt = accept_or_resample(p, q, c.drafts, s.generator)
    tokens = c.drafts[:kept] + [nxt]
    logp = reported_logprobs(logits[: kept + 1], params[: kept + 1])
    chosen = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    n = s.request.params.logprobs
    tops = [None] * len(tokens)
    if n:
        top = logp.topk(n, dim=-1)
        tops = [(top.values[i], top.indices[i]) for i in range(len(tokens))]
    kv = [c.cached + 1 + i for i in range(len(tokens))]
    return Emitted(s, tokens, chosen, tops, kv, kept, len(c.drafts))


def _roll_back(runner: ModelRunner, blocks: BlockManager, c: Drafting, e: Emitted) -> None:
    """Keep the last token's and the kept drafts' dense keys; give back pages past them."""
    s = c.seq
    s.cached = c.cached + 1 + e.kept
    keep = blocks.pages_for(s.cached)
    blocks.free_pages(s.pages[keep:])
    del s.pages[keep:]
    filled = s.cached % blocks.page_size
    if filled:
        runner.cache.recompute_centroids(s.pages[-1], filled)
