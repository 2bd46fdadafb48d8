"""The eviction rules of eviction.py in torch, batched over samples and KV heads.

The engine's compaction (stages/engine/compaction.py) and teacher-forced replay
(stages/attention/eviction_replay.py) both call `retained_slots`, on whatever device the cache lives;
the tests hold it to a float64 brute force written from the papers' definitions. Scores are computed in
float32 at least (float64 stays float64).
R-KV's [L, L] similarity is built in blocks of rows, so a first compression over a long prompt never
holds a [Hkv, L, L] matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SIMILARITY_ELEMENTS = 1 << 24  # a block of R-KV's similarity rows holds at most this many numbers


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def attention_importance(q_window: Tensor, keys: Tensor, window: int, kernel: int) -> Tensor:
    """SnapKV's pooled importance of the non-window slots.

    q_window [B, Hq, W, D]: the post-RoPE queries of the last W positions (any order: they are averaged);
    keys [B, Hkv, L, D] in slot order -> [B, Hkv, L - W]."""
    b, hq, w, d = q_window.shape
    hkv, length = keys.shape[1], keys.shape[2]
    q = _wide(q_window).view(b, hkv, hq // hkv, w, d)
    k = _wide(keys[:, :, : length - window])
    logits = torch.einsum("bhgwd,bhld->bhgwl", q, k) * d ** -0.5
    probs = logits.amax(2).softmax(-1).mean(2)  # max over the group, softmax over keys, mean over queries
    pooled = F.max_pool1d(probs.reshape(b * hkv, 1, -1), kernel, stride=1, padding=kernel // 2)
    return pooled.view(b, hkv, -1)


def key_redundancy(keys: Tensor, threshold: float) -> Tensor:
    """R-KV's redundancy of every slot: [B, Hkv, L, D] -> [B, Hkv, L] (a softmax over the slots)."""
    b, hkv, length, _ = keys.shape
    k = _wide(keys)
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    column_sums = torch.zeros(b, hkv, length, dtype=k.dtype, device=k.device)
    slots = torch.arange(length, device=k.device)
    rows = max(1, SIMILARITY_ELEMENTS // max(b * hkv * length, 1))
    for lo in range(0, length, rows):
        hi = min(length, lo + rows)
        sim = unit[:, :, lo:hi] @ unit.transpose(-1, -2)  # [B, Hkv, R, L]
        sim = sim.masked_fill(slots[lo:hi, None] == slots[None, :], 0.0)  # a slot is not its own duplicate
        latest = torch.where(sim > threshold, slots, 0).amax(-1, keepdim=True)  # [B, Hkv, R, 1]
        sim = sim.scatter(-1, latest, 0.0)  # each row forgives its most recent look-alike (slot 0 if none)
        column_sums += sim.sum(-2)
    return (column_sums / length).softmax(-1)


def retained_slots(policy, q_window: Tensor, keys: Tensor) -> Tensor:
    """The slots `policy` (an `Eviction`) keeps of a cache of L slots: the sink, the window and the
    best-scored candidates, ties toward the earlier slot -> [B, Hkv, budget] int64, ascending."""
    b, hkv, length = keys.shape[0], keys.shape[1], keys.shape[2]
    sink, window, budget = policy.sink, policy.window, policy.budget
    if length <= budget:
        return torch.arange(length, device=keys.device).expand(b, hkv, length).clone()
    scores = policy.scores(q_window, keys)[..., sink:]  # candidates: slots sink..L-W-1
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # stable: earlier wins ties
    chosen = order[..., : budget - sink - window] + sink
    fixed = torch.cat([torch.arange(sink, device=keys.device),
                       torch.arange(length - window, length, device=keys.device)])
    kept = torch.cat([fixed.expand(b, hkv, -1), chosen], dim=-1)
    return kept.sort(dim=-1).values
