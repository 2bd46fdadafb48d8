"""Batched sampling: temperature, top-k, top-p, one seed per sample.

Logprobs are log_softmax(logits / T) of the sampled token (T = 1 when greedy), before truncation. A row
draws by an exponential race, argmax p / E. The host path (`sample_tokens`) races with each sample's own
generator, so a draw does not depend on the batch. The device path (`sample_on_device`,
`sample_by_position`, the static step's) races with counter noise keyed by the sample's seed and the
query's position, the same draw on every device; rows with top-k/top-p are drawn again over the
truncated set, still on the device.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from sparrow.kernels import ops as kernel_ops
from sparrow.kernels.ops import TorchOps

from ..attention.kv_cache import upload
from .sequence import SamplingParams


def logprobs_at_temperature(logits: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """The engine's logprob convention: log_softmax(logits / T) [n, V] before truncation (T = 1 when
    greedy)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
    return torch.log_softmax(logits.float() / temps.to(logits.device), dim=-1)


def sample_tokens(logits: Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
                  top_logprobs: int = 0):
    """logits [B, V] -> (tokens [B], logprobs [B], top (values, ids) [B, k] or None), on the CPU."""
    logits = logits.float()
    dev = logits.device
    temps = [p.temperature for p in params]
    if any(t > 0 and t != 1 for t in temps):  # T = 1 and greedy rows need no division
        logits = logits / torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev)[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    rows = [i for i, t in enumerate(temps) if t > 0]
    tokens = logits.argmax(-1) if len(rows) < len(temps) else torch.empty(len(temps), dtype=torch.long,
                                                                           device=dev)
    if rows:
        sub = [params[i] for i in rows]
        picked = logp if len(rows) == len(temps) else logp[torch.tensor(rows, device=dev)]
        if any(p.top_k > 0 or p.top_p < 1 for p in sub) or not kernel_ops.host_race_usable(logp):
            drawn = _race(picked.exp(), sub, [generators[i] for i in rows])
        else:  # the same race in one C++ pass, its noise from one seed per row (kernels/cpu_sampling.py)
            drawn = kernel_ops.host_race(picked, kernel_ops.draw_seeds([generators[i] for i in rows]))
        if len(rows) == len(temps):
            tokens = drawn
        else:
            tokens[torch.tensor(rows, device=dev)] = drawn
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top = logp.topk(top_logprobs, dim=-1) if top_logprobs > 0 else None
    return tokens.cpu(), chosen.cpu(), (None if top is None else (top.values.cpu(), top.indices.cpu()))


def _race(probs: Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator]) -> Tensor:
    """Rows of probabilities [n, V], truncated by top-k then top-p, each drawn by its generator -> [n]."""
    probs = truncate(probs, params)
    # exponential race: argmax p / E with E ~ Exp(1) draws from p exactly; one noise draw per sample
    # from its own generator (torch.multinomial per row costs about 13 launches each), then one batched
    # argmax. E = -log U: on a CPU uniform_ is vectorised and exponential_ is not
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].uniform_(generator=g)
    noise = noise.log_().neg_()
    return probs.div_(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(-1)


def truncate(probs: Tensor, params: Seq[SamplingParams]) -> Tensor:
    """Rows of probabilities [n, V] with what top-k then top-p (of the top-k distribution) drop set to 0."""
    dev = probs.device
    top_k = upload(dev, [p.top_k for p in params], torch.long)
    if any(p.top_k > 0 for p in params):
        kmax = max(p.top_k for p in params)  # from the host: no device sync
        kth = probs.topk(min(kmax, probs.shape[-1]), dim=-1).values
        idx = (top_k.clamp(1, kth.shape[-1]) - 1)[:, None]
        thresh = torch.where(top_k[:, None] > 0, kth.gather(-1, idx), 0.0)
        probs = probs * (probs >= thresh)
    if any(p.top_p < 1 for p in params):
        top_p = upload(dev, [p.top_p for p in params], torch.float32)
        sorted_p, order = probs.sort(-1, descending=True)
        # cumulative mass of the kept distribution before each token; keeps the most likely one
        cum = sorted_p.cumsum(-1) - sorted_p
        mass = torch.where(top_k > 0, sorted_p.sum(-1), 1.0)  # top-p of the top-k distribution
        keep = cum < top_p[:, None] * mass[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    return probs


# ---------------------------------------------------------------------------------------- device path

def sample_on_device(logits: Tensor, temperatures: Tensor, seeds: Tensor, positions: Tensor,
                     logp_out: Tensor | None = None, ops: TorchOps = kernel_ops.TORCH,
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy and untruncated rows, on logits' device with no host sync (a CUDA graph captures it).

    logits [B, V] fp32; temperatures [B] fp32 (0 = greedy); seeds [B] int64 the samples' seeds; positions
    [B] int64 of the queries that produced the logits -> (tokens [B] int64, their logprobs [B] fp32,
    log_softmax(logits / T) [B, V] fp32, written into `logp_out` when given)."""
    greedy = logits.argmax(-1)
    scaled = logits / torch.where(temperatures > 0, temperatures, 1.0)[:, None]
    logp = torch.log_softmax(scaled, -1) if logp_out is None else torch.log_softmax(scaled, -1, out=logp_out)
    drawn = ops.race_sample(logp, seeds, positions)
    tokens = torch.where(temperatures > 0, drawn, greedy)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0], logp


def redraw_truncated(logp: Tensor, params: Seq[SamplingParams], seeds: Tensor, positions: Tensor,
                     ops: TorchOps = kernel_ops.TORCH) -> Tensor:
    """Rows [n, V] of log-probabilities of samples with top-k/top-p: the same race over the truncated set
    (the row's log-probs, -inf outside it) -> tokens [n] int64 on logp's device."""
    keep = truncate(logp.exp(), params) > 0
    return ops.race_sample(logp.masked_fill(~keep, float("-inf")), seeds, positions)


def sample_by_position(logits: Tensor, params: Seq[SamplingParams], seeds: Seq[int], positions: Seq[int],
                       top_logprobs: int = 0, ops: TorchOps = kernel_ops.TORCH):
    """The device path's draws outside the step (a prefill's first tokens, a step that does not fit the
    static buffers) -> (tokens [B], logprobs [B], top (values, ids) [B, k] or None), on the CPU."""
    dev = logits.device
    logits = logits.float()
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    seed_t = torch.tensor(list(seeds), dtype=torch.long, device=dev)
    pos_t = torch.tensor(list(positions), dtype=torch.long, device=dev)
    tokens, chosen, logp = sample_on_device(logits, temps, seed_t, pos_t, ops=ops)
    rows = [i for i, p in enumerate(params) if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)]
    if rows:
        r = torch.tensor(rows, device=dev)
        tokens[r] = redraw_truncated(logp[r], [params[i] for i in rows], seed_t[r], pos_t[r], ops)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
    top = logp.topk(top_logprobs, dim=-1) if top_logprobs > 0 else None
    return tokens.cpu(), chosen.cpu(), (None if top is None else (top.values.cpu(), top.indices.cpu()))
