"""Exact speculative decoding with the sparse actor as the draft model (`EngineConfig.speculate = K`).

A cycle drafts up to K tokens per running sample with the sample's own KV policy (decode steps at its
budget, each writing the fed token's keys), then one dense forward per sample over the K+1 fed positions
(its last token and the drafts) rewrites their keys and values densely and gives the dense distributions.
Draft j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the next token is drawn
from normalize(max(0, p_j - q_j)), and when every draft is kept a bonus token comes from the last dense
row. So the emitted tokens are distributed exactly as dense sampling's (speculative sampling, Leviathan et
al. 2023, Chen et al. 2023); temperature, top-k and top-p shape p and q alike before the rule, and a greedy
row keeps a draft iff it is the dense argmax. The reported logprobs are the dense model's.

The cache is then rolled back to the kept positions: pages past them go back to the pool and the kept
pages the cycle wrote get their centroids recomputed from the slots that stay. What a mean acceptance
predicts per cycle: stages/speculative_plan.py.

Drafting and verification run where the runner's decode steps run. On the plain step the host draws
each draft with the sample's generator and stops a sample at a stop token, and the verification is one
forward over the samples' fed tokens. On the static step (CUDA graphs on a GPU) the device draws each
draft (the race keyed by seed and position, as every static step does) and feeds it to the next step with
no host round trip; each step's log-probs are kept for the rule, and drafts past a stop token are dropped
when read back; the later drafts of a cycle attend to the pages its first draft selected
(`EngineConfig.reuse_draft_pages`); the verification is a scoring step of the same buffers, one row per
fed token. A
position's key never draws twice for what is emitted: a cycle starts after the last position whose draft
was looked at. The rule's own draws use the sample's generator either way, so a seed gives the same
rollouts whatever the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..attention.kv_cache import download, upload
from .block_manager import BlockManager
from .runner import ModelRunner
from .sampler import logprobs_at_temperature, truncate
from .sequence import SamplingParams, Sequence
from .static_decode import Select


def sampling_probs(logits: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """logits [n, V] -> the distributions the rows draw from [n, V] float32: softmax(logits / T) truncated
    by top-k then top-p and renormalised; a greedy row is one-hot at its argmax."""
    return probs_of(logprobs_at_temperature(logits, params), params)


def probs_of(logp: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """log_softmax(logits / T) [n, V] -> the distributions the rows draw from (as `sampling_probs`)."""
    probs = truncate(logp.exp(), params)
    probs = probs / probs.sum(-1, keepdim=True)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:
        rows = upload(logp.device, greedy, torch.long)
        probs[rows] = torch.nn.functional.one_hot(logp[rows].argmax(-1), logp.shape[-1]).float()
    return probs


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token from a distribution [V] by an exponential race, argmax p / E with E ~ Exp(1) (exact, and
    one uniform pass instead of multinomial's cumulative sum); without a generator (greedy) its argmax.
    -> a 0-dim int64 tensor on probs' device (no host sync)."""
    if generator is None:
        return probs.argmax()
    noise = torch.empty_like(probs).uniform_(generator=generator).log_().neg_()
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax()


def accept_or_resample(p: Tensor, q: Tensor, drafts: Tensor, generator: torch.Generator | None,
                       ) -> tuple[Tensor, Tensor]:
    """The rule for one sample, the reference `accept_or_resample_batch` (which the engine runs) is held
    to; on p's device with no host sync. p [k+1, V] dense distributions at the k+1 fed positions,
    q [k, V] the distributions the k drafts [k] (int64) were drawn from -> (drafts kept, the token that
    follows them), 0-dim int64 tensors. Every draft gets a uniform; those after the first rejection are
    never looked at."""
    k = len(drafts)
    rows = torch.arange(k, device=p.device)
    p_at, q_at = p[rows, drafts], q[rows, drafts]
    if generator is None:
        keep = p_at > 0  # one-hot rows: the draft is the dense argmax
    else:
        keep = torch.rand(k, generator=generator, device=p.device) * q_at < p_at
    kept = keep.long().cumprod(0).sum()  # the drafts before the first rejection
    # at a rejection, normalize(max(0, p - q)); when every draft is kept, the bonus row p[k] (q padded by 0)
    target = p[kept]
    residual = (target - torch.cat([q, torch.zeros_like(p[:1])])[kept]).clamp_(min=0.0)
    total = residual.sum()
    return kept, draw(torch.where(total > 0, residual / total, target), generator)


def accept_or_resample_batch(p: Tensor, q: Tensor, drafts: Tensor, counts: Seq[int],
                             generators: Seq[torch.Generator | None]) -> tuple[Tensor, Tensor]:
    """`accept_or_resample` for B samples at once, with no host sync: p [B, K+1, V] each sample's dense
    distributions at its fed positions, q [B, K+1, V] the distributions its drafts were drawn from (rows
    at and past its count of drafts all zero), drafts [B, K] int64 (padding: any token), counts the drafts
    each made -> (kept [B], next [B]) int64. Each sample's generator gives its uniforms, then its race's
    noise, as `accept_or_resample` draws them: the same generator states give the same tokens."""
    B, K = drafts.shape
    dev = p.device
    greedy = [g is None for g in generators]
    u = torch.zeros(B, K, device=dev)
    noise = torch.ones(B, p.shape[-1], device=dev)
    for i, (g, n) in enumerate(zip(generators, counts)):
        if g is not None:
            u[i, :n] = torch.rand(n, generator=g, device=dev)
            noise[i].uniform_(generator=g)
    noise = noise.log_().neg_().clamp_(min=torch.finfo(noise.dtype).tiny)
    is_greedy = upload(dev, greedy, torch.bool)[:, None]
    valid = torch.arange(K, device=dev) < upload(dev, list(counts), torch.long)[:, None]
    p_at = p[:, :K].gather(2, drafts[..., None])[..., 0]  # [B, K]
    q_at = q[:, :K].gather(2, drafts[..., None])[..., 0]
    keep = torch.where(is_greedy, p_at > 0, u * q_at < p_at) & valid
    kept = keep.long().cumprod(1).sum(1)  # [B]
    at = kept[:, None, None].expand(B, 1, p.shape[-1])
    target = p.gather(1, at)[:, 0]  # [B, V]
    residual = (target - q.gather(1, at)[:, 0]).clamp_(min=0.0)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total, target)
    return kept, torch.where(is_greedy[:, 0], dist.argmax(-1), (dist / noise).argmax(-1))


class DeviceTimer:
    """Seconds of a span of device work: CUDA events, read after the host has waited for later work (no
    sync of its own), or the host's clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3
        return self.t1 - self.t0


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
    dense logprobs, top logprobs rows (or None) and the KV tokens the cache held at each token."""

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
    timer = DeviceTimer(runner.device)
    timer.start()
    dense = runner.verify(seqs, [c.cached for c in cycles])
    timer.stop()
    out = _decide(cycles, dense)
    _roll_back(runner, blocks, cycles, out)
    return Cycle(out, timer.seconds())


def _draft(runner: ModelRunner, cycles: list[Drafting]) -> None:
    """Up to K decode steps, each sample at its policy's budget: on the runner's static step when the batch
    fits it, else plain steps."""
    if runner.pipelines([c.seq for c in cycles]):
        _draft_on_device(runner, cycles)
    else:
        _draft_on_host(runner, cycles)


def _draft_on_host(runner: ModelRunner, cycles: list[Drafting]) -> None:
    """Plain decode steps of the samples still drafting, each draft drawn with the sample's generator."""
    while active := [c for c in cycles if c.open]:
        seqs = [c.seq for c in active]
        logits = runner.decode(seqs, [s.budget_now() for s in seqs])
        probs = sampling_probs(logits, [s.request.params for s in seqs])
        for c, q in zip(active, probs):
            token = int(draw(q, c.seq.generator))
            c.drafts.append(token)
            c.probs.append(q)
            c.seq.tokens.append(token)  # fed by the next draft step, then taken back
            c.seq.cached += 1


def _draft_on_device(runner: ModelRunner, cycles: list[Drafting]) -> None:
    """Static decode steps back to back: step j runs the samples that may make a j-th draft, feeding the
    token the device drew at step j - 1; the host reads each step's drafts while the next one runs."""
    runner.forget_rows()  # the last cycle's roll back moved every sample's state
    launched: list[tuple[list[Drafting], Tensor]] = []
    read = 0
    reuse = runner.config.reuse_draft_pages
    for j in range(max(c.limit for c in cycles)):
        active = [c for c in cycles if c.limit > j]
        seqs = [c.seq for c in active]
        select = Select.EVERY if not reuse else Select.REUSE if j else Select.KEEP
        runner.launch_decode(seqs, [s.budget_now(ahead=j) for s in seqs], select)
        launched.append((active, runner.step_logprobs(len(active))))
        for out in runner.collect(keep=1):
            _take_drafts(*launched[read], out.tokens)
            read += 1
    for out in runner.collect(keep=0):
        _take_drafts(*launched[read], out.tokens)
        read += 1
    for c in cycles:
        eos = next((i for i, t in enumerate(c.drafts) if t in c.seq.request.eos_ids), None)
        if eos is not None:  # drafts past a stop token are never emitted: not verified either
            del c.drafts[eos + 1:], c.probs[eos + 1:]
        c.seq.tokens.extend(c.drafts)
        c.seq.cached += len(c.drafts)


def _take_drafts(active: list[Drafting], logp: Tensor, tokens: list[int]) -> None:
    probs = probs_of(logp, [c.seq.request.params for c in active])
    for c, q, token in zip(active, probs, tokens):
        c.drafts.append(token)
        c.probs.append(q)


def _padded_rows(cycles: list[Drafting]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's rows padded to K + 1 columns: (its fed tokens' rows of the verification's log-probs,
    its last repeated; its drafts' rows of the stacked q, the zero row past them (index: the number of
    drafts); its drafts [B, K], padding 0)."""
    counts = np.array([len(c.drafts) for c in cycles])
    j = np.arange(counts.max() + 1)
    starts = np.cumsum(counts + 1) - (counts + 1)
    fed = starts[:, None] + np.minimum(j, counts[:, None])
    first = np.cumsum(counts) - counts
    q_rows = np.where(j < counts[:, None], first[:, None] + j, counts.sum())
    drafts = np.zeros((len(cycles), counts.max()), dtype=np.int64)
    for i, c in enumerate(cycles):
        drafts[i, : len(c.drafts)] = c.drafts
    return fed, q_rows, drafts


def _decide(cycles: list[Drafting], logp: Tensor) -> list[Emitted]:
    """The rule over the dense log_softmax(logits / T) [every sample's fed tokens, V], every sample at once:
    each sample's drafts taken back off its tokens, the kept ones and the next token emitted with the dense
    model's logprobs. One host read, after the device has computed everything the host needs."""
    dev, vocab = logp.device, logp.shape[-1]
    counts = [len(c.drafts) for c in cycles]
    params = [c.seq.request.params for c, n in zip(cycles, counts) for _ in range(n + 1)]
    fed, q_rows, drafts = (upload(dev, a, torch.long) for a in _padded_rows(cycles))
    q_flat = torch.stack([q for c in cycles for q in c.probs] + [logp.new_zeros(vocab)])  # the zero row last
    kept, nxt = accept_or_resample_batch(probs_of(logp, params)[fed], q_flat[q_rows], drafts, counts,
                                         [c.seq.generator for c in cycles])
    # the emitted tokens, the kept drafts then the next token, each scored at its fed row
    tokens = torch.cat([drafts, drafts.new_zeros(len(cycles), 1)], 1).scatter_(1, kept[:, None], nxt[:, None])
    rows = logp[fed]  # [B, K+1, V]
    chosen = rows.gather(2, tokens[..., None])[..., 0]
    decided = torch.cat([kept[:, None].double(), nxt[:, None].double(), chosen.double()], 1)
    n = max(c.seq.request.params.logprobs for c in cycles)
    if n:
        top = rows.topk(n, dim=-1)
        decided, values, ids = download(decided, top.values, top.indices)
    else:
        (decided,) = download(decided)
    out = []
    for i, (c, row) in enumerate(zip(cycles, decided.tolist())):
        kept_i = int(row[0])
        toks = c.drafts[:kept_i] + [int(row[1])]
        del c.seq.tokens[c.generated:]
        tops = [(values[i, t], ids[i, t]) if n else None for t in range(len(toks))]
        kv = [c.cached + 1 + t for t in range(len(toks))]
        out.append(Emitted(c.seq, toks, row[2: 2 + len(toks)], tops, kv, kept_i, len(c.drafts)))
    return out


def _roll_back(runner: ModelRunner, blocks: BlockManager, cycles: list[Drafting], out: list[Emitted]) -> None:
    """Keep each sample's last token's and kept drafts' dense keys, give back the pages past them, and
    set the centroids of the kept pages the cycle wrote from their keys (the drafts' appends and the
    verification's rewrites of the same slots leave them stale)."""
    P, pages, filled = blocks.page_size, [], []
    for c, e in zip(cycles, out):
        s = c.seq
        s.cached = c.cached + 1 + e.kept
        keep = blocks.pages_for(s.cached)
        blocks.free_pages(s.pages[keep:])
        del s.pages[keep:]
        for i in range(c.cached // P, keep):
            pages.append(s.pages[i])
            filled.append(min(P, s.cached - i * P))
    runner.cache.recompute_centroids(pages, filled)
