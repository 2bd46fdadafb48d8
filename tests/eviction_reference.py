"""A brute-force decoder with eviction, written from the definitions (stages/kv_policies/eviction.py's
docstring) for the tests: float64, one token at a time, a contiguous per-position cache, a list of
kept positions per layer and KV head, attention written out per query head, compressions chosen by
`test_kv_eviction.brute_force_kept` (the papers' rules as loops). No code of the engine, the replay
or the torch scoring runs in it; only the model's projections, norms and RoPE (our decoder, in
float64) produce the q, k, v it attends with."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from test_kv_eviction import brute_force_kept


class BruteForceEviction:
    """Our decoder's Attention, token by token over the positions each KV head keeps."""

    def __init__(self, policy, num_layers: int):
        self.policy = policy
        self.keys = [dict() for _ in range(num_layers)]  # position -> [Hkv, D]
        self.values = [dict() for _ in range(num_layers)]
        self.queries = [dict() for _ in range(num_layers)]  # position -> [Hq, D]
        self.kept: list[list[list[int]] | None] = [None] * num_layers  # per layer, per KV head

    def __call__(self, layer, q, k, v, ctx):
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
        group = hq // hkv
        if self.kept[layer] is None:
            self.kept[layer] = [[] for _ in range(hkv)]
        out = torch.zeros_like(q)
        for t in range(q.shape[2]):
            p = int(ctx.positions[0, t])
            self.keys[layer][p] = k[0, :, t].numpy()
            self.values[layer][p] = v[0, :, t].numpy()
            self.queries[layer][p] = q[0, :, t].numpy()
            for h in range(hkv):
                self.kept[layer][h].append(p)
            for g in range(hq):
                h = g // group
                kept = self.kept[layer][h]
                query = q[0, g, t].numpy()
                logits = [float(np.dot(query, self.keys[layer][j][h])) / math.sqrt(d) for j in kept]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                out[0, g, t] = torch.from_numpy(sum(w / total * self.values[layer][j][h]
                                                    for w, j in zip(weights, kept)))
        return out

    def compress(self, last_position: int) -> None:
        w = self.policy.window
        for layer, kept in enumerate(self.kept):
            recent = range(last_position - w + 1, last_position + 1)
            window = np.stack([self.queries[layer][p] for p in recent], axis=1)  # [Hq, W, D]
            keys = np.stack([np.stack([self.keys[layer][p][h] for p in positions])
                             for h, positions in enumerate(kept)])  # [Hkv, L, D]
            slots = brute_force_kept(self.policy, window, keys)
            self.kept[layer] = [[positions[s] for s in slots[h]] for h, positions in enumerate(kept)]


def float64_copy(model):
    return copy.deepcopy(model).double()


@torch.no_grad()
def brute_force_logprobs(model64, prompt: list[int], completion: list[int], policy,
                         temperature: float = 1.0) -> tuple[np.ndarray, list]:
    """Each completion token's logprob (at `temperature`) under decoding with `policy`'s eviction,
    teacher forced one token at a time; and the kept positions [layer][head] at the end."""
    attention = BruteForceEviction(policy, model64.cfg.num_layers)
    n = len(prompt)
    temp = temperature if temperature > 0 else 1.0

    def logprob(h, token):
        return float(torch.log_softmax(model64.logits(h) / temp, -1)[token])

    h = model64.hidden_states(torch.tensor([prompt]), positions=torch.arange(n)[None], attention=attention)
    out = [logprob(h[0, -1], completion[0])]
    cached = n
    for j, token in enumerate(completion[:-1]):
        h = model64.hidden_states(torch.tensor([[token]]), positions=torch.tensor([[n + j]]),
                                  attention=attention)
        out.append(logprob(h[0, 0], completion[j + 1]))
        cached += 1
        if cached >= policy.budget + policy.buffer:  # the cache is full: compress before the next step
            attention.compress(n + j)
            cached = policy.budget
    return np.array(out), attention.kept
