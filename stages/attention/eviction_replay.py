"""Teacher-forced replay of an eviction policy: what decoding with eviction computed, a run at a time.

Between two compressions every query attends to the set retained at the last compression plus the
tokens fed since, causally; so the fed tokens of one run (`Eviction.segments`) go through the model in
one forward whose attention (`ReplayAttention`) reads a contiguous per-sequence cache of the retained
keys and values, appends the run's, attends with a causal mask aligned to the lower right, and, when
the run ends at a compression, compresses the layer's cache with the same rule decoding applies
(`Eviction.retained`, on the last `window` queries of the layer). Positions are the tokens' true
positions throughout (RoPE is applied by the model from them), so the cache holds each kept key as
decoding wrote it, up to float rounding.

`replay` serves teacher-forced scoring (stages/scoring/mismatch.py: logprobs and alpha of every generated
token under the compressed actor) and the rollout engine's recompute of a preempted evicting sample
(stages/engine: the final state is written into its pages). Sequences replayed together must share
their prompt length (their compressions then fall on the same runs); the prompt is prefilled in
chunks of at most `prefill_chunk` tokens, never compressed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv_policies.eviction import Eviction
from ..model.llama import AttentionContext, Transformer
from .paged import attend_after_prefix


class ReplayAttention:
    """Our decoder's `Attention` over a contiguous, compressed per-sequence cache, layer by layer.

    Per layer: k, v [B, Hkv, L, D] (slot order = position order), positions [B, Hkv, L] int64 (each kept
    token's original position), queries [B, Hq, <= W, D] (the last W post-RoPE queries, in order)."""

    def __init__(self, policy: Eviction, num_layers: int):
        self.policy = policy
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.positions: list[Tensor | None] = [None] * num_layers
        self.queries: list[Tensor | None] = [None] * num_layers
        self.compress = False  # compress every layer after this forward (set per run)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        hkv = k.shape[1]
        pos = ctx.positions[:, None, :].expand(-1, hkv, -1)
        if self.k[layer] is None:
            keys, values, positions = k, v, pos
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys = torch.cat([self.k[layer], k], dim=2)
            values = torch.cat([self.v[layer], v], dim=2)
            positions = torch.cat([self.positions[layer], pos], dim=2)
            out = attend_after_prefix(q, keys, values)
        seen = q if self.queries[layer] is None else torch.cat([self.queries[layer], q], dim=2)
        queries = seen[:, :, -self.policy.window:]
        if self.compress and keys.shape[2] > self.policy.budget:
            kept = self.policy.retained(queries, keys)  # [B, Hkv, budget]
            index = kept[..., None].expand(-1, -1, -1, keys.shape[3])
            keys, values = keys.gather(2, index), values.gather(2, index)
            positions = positions.gather(2, kept)
        self.k[layer], self.v[layer], self.positions[layer] = keys, values, positions
        self.queries[layer] = queries.clone()  # not a view that would keep a whole chunk's queries alive
        return out


@dataclass
class Replay:
    last_prompt: Tensor  # [B, hidden]: the final hidden state of the prompt's last position
    hidden: Tensor  # [B, fed, hidden]: the final hidden state at each fed token (predicts the next)
    state: ReplayAttention  # the retained cache and query window after the last fed token


def replay(model: Transformer, prompts: Tensor, fed: Tensor, policy: Eviction,
           prefill_chunk: int | None = None) -> Replay:
    """Prefill `prompts` [B, n] (one length), then feed `fed` [B, F] (token j at position n + j) run by
    run under `policy`'s eviction. Call under torch.inference_mode() (or no_grad)."""
    b, n = prompts.shape
    device = prompts.device
    attention = ReplayAttention(policy, model.cfg.num_layers)
    chunk = prefill_chunk or n
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        h = model.hidden_states(prompts[:, start:end], positions=_positions(b, start, end, device),
                                attention=attention)
    last_prompt = h[:, -1]
    hidden = []
    for start, end, compress in policy.segments(n, fed.shape[1]):
        attention.compress = compress
        positions = _positions(b, n + start, n + end, device)
        hidden.append(model.hidden_states(fed[:, start:end], positions=positions, attention=attention))
    attention.compress = False
    out = torch.cat(hidden, dim=1) if hidden else last_prompt.new_zeros(b, 0, last_prompt.shape[-1])
    return Replay(last_prompt, out, attention)


def _positions(b: int, start: int, end: int, device) -> Tensor:
    return torch.arange(start, end, device=device).expand(b, end - start)
