"""SnapKV and R-KV eviction (stages/kv_policies) against a float64 brute force written from the papers'
definitions (and the Sparse-RL release's constants), one KV head and one window query at a time, in
plain Python over numpy rows; plus the policies' bookkeeping (when compressions fall, how long a cache
gets) against a token-by-token simulation, and their specs."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from sparrow.stages.core.sparsity import as_policy, parse_sparsity
from sparrow.stages.kv_policies.eviction import RKV, SnapKV, parse_eviction
from sparrow.stages.kv_policies.scoring import retained_slots


def brute_force_kept(policy, q_window: np.ndarray, keys: np.ndarray) -> list[list[int]]:
    """q_window [Hq, W, D], keys [Hkv, L, D] (one sample, float64) -> the kept slots of each KV head."""
    hq, w, d = q_window.shape
    hkv, length, _ = keys.shape
    group = hq // hkv
    rkv = isinstance(policy, RKV)
    kept_all = []
    for h in range(hkv):
        n = length - w  # the non-window slots, the only ones scored
        # SnapKV: a window query's logits, pooled over its group by max, softmax over the non-window keys
        probs = np.zeros((w, n))
        for i in range(w):
            logits = [max(float(np.dot(q_window[g, i], keys[h, j])) / math.sqrt(d)
                          for g in range(h * group, (h + 1) * group)) for j in range(n)]
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            probs[i] = [x / sum(e) for x in e]
        importance = [sum(probs[i, j] for i in range(w)) / w for j in range(n)]
        half = policy.kernel // 2
        pooled = [max(importance[max(0, j - half): min(n, j + half + 1)]) for j in range(n)]
        score = pooled
        if rkv:  # R-KV: redundancy from the keys' cosine similarity
            unit = [keys[h, j] / (np.linalg.norm(keys[h, j]) + 1e-8) for j in range(length)]
            sim = [[0.0 if i == j else float(np.dot(unit[i], unit[j])) for j in range(length)]
                   for i in range(length)]
            for i in range(length):
                similar = [j for j in range(length) if sim[i][j] > policy.threshold]
                sim[i][max(similar) if similar else 0] = 0.0
            mean = [sum(sim[i][j] for i in range(length)) / length for j in range(length)]
            top = max(mean)
            e = [math.exp(x - top) for x in mean]
            redundancy = [x / sum(e) for x in e]
            lam = policy.mix_lambda
            score = [lam * pooled[j] - (1 - lam) * redundancy[j] for j in range(n)]
        candidates = sorted(range(policy.sink, n), key=lambda j: (-score[j], j))
        chosen = candidates[: policy.budget - policy.sink - w]
        kept_all.append(sorted(list(range(policy.sink)) + chosen + list(range(n, length))))
    return kept_all


@pytest.mark.parametrize("cls", [SnapKV, RKV])
@pytest.mark.parametrize("length,budget,window,sink,group", [(40, 20, 8, 4, 2), (61, 30, 5, 0, 1),
                                                              (96, 64, 8, 4, 4)])
def test_retained_slots_match_the_brute_force(cls, length, budget, window, sink, group):
    g = torch.Generator().manual_seed(length + budget)
    hkv, d = 2, 16
    q = torch.randn(3, hkv * group, window, d, generator=g, dtype=torch.float64)
    k = torch.randn(3, hkv, length, d, generator=g, dtype=torch.float64) * 1.5
    k[1, :, 10:20] = k[1, :, 10:11] + 0.05 * k[1, :, 10:20]  # near duplicates: R-KV's redundancy matters
    policy = cls(budget, window=window, sink=sink, buffer=8)
    got = retained_slots(policy, q, k)
    assert got.shape == (3, hkv, budget)
    for b in range(3):
        assert got[b].tolist() == brute_force_kept(policy, q[b].numpy(), k[b].numpy())
    # the sink and the window are always kept
    assert bool((got[..., :sink] == torch.arange(sink)).all())
    assert bool((got[..., budget - window:] == torch.arange(length - window, length)).all())


def test_rkv_evicts_duplicates_that_snapkv_keeps():
    """Keys repeated many times with high attention: SnapKV keeps the copies, R-KV spends the budget
    elsewhere (the redundancy term), as the paper intends."""
    g = torch.Generator().manual_seed(0)
    d, length, window = 16, 64, 8
    k = torch.randn(1, 1, length, d, generator=g, dtype=torch.float64)
    k[0, 0, 20:40] = k[0, 0, 20] + 0.01 * torch.randn(20, d, generator=g, dtype=torch.float64)
    q = k[0, 0, 20].expand(1, 1, window, d).clone() * 0.5  # the window attends to the copies
    snap = set(retained_slots(SnapKV(32, window=window), q, k)[0, 0].tolist())
    rkv = set(retained_slots(RKV(32, window=window), q, k)[0, 0].tolist())
    copies = set(range(20, 40))
    assert len(snap & copies) > len(rkv & copies)


def test_ties_keep_the_earlier_positions():
    q = torch.zeros(1, 2, 4, 8)  # every logit 0: uniform importance, every candidate tied
    k = torch.randn(1, 2, 30, 8)
    kept = retained_slots(SnapKV(12, window=4, sink=2), q, k)
    assert kept[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 26, 27, 28, 29]


@pytest.mark.parametrize("cls", [SnapKV, RKV])
@pytest.mark.parametrize("prompt", [5, 37, 100, 200])
def test_cache_lengths_and_runs_follow_the_token_by_token_rule(cls, prompt):
    """cache_len, max_cache and segments against a simulation: append one token per step, compress to
    the budget after a step that leaves budget + buffer tokens or more."""
    policy = cls(40, window=8, buffer=24, sink=4)
    cached, peak, runs, start = prompt, prompt, [], 0
    for fed in range(1, 300):
        cached += 1
        peak = max(peak, cached)
        if cached >= policy.capacity:
            cached = policy.budget
            runs.append((start, fed, True))
            start = fed
        assert policy.cache_len(prompt, fed) == cached
        assert policy.max_cache(prompt, fed + 1) == peak
        assert policy.segments(prompt, fed) == runs + ([(start, fed, False)] if start < fed else [])
    assert policy.cache_len(prompt, 0) == prompt and policy.segments(prompt, 0) == []


def test_specs_round_trip_and_bad_ones_get_one_sentence():
    policy = parse_sparsity("rkv:96,window=4,buffer=32")
    assert policy == RKV(96, window=4, buffer=32) and policy.capacity == 128
    assert parse_sparsity(policy.spec()) == policy and as_policy(policy.spec()) == policy
    assert parse_eviction("snapkv:64") == SnapKV(64, window=8, buffer=128, sink=4)
    for spec, message in [
        ("snapkv:12", "snapkv:12: the budget must exceed the sink plus the window (4 + 8 = 12 tokens)"),
        ("h2o:64", "unknown sparsity 'h2o:64': expected dense, budget:B, schedule:FILE, snapkv:B or rkv:B"),
        ("rkv:x", "the KV budget must be an integer"),
        ("rkv:64,kernel=5", "unknown option 'kernel'"),
        ("rkv:64,window=8,window=9", "window= is given twice; give it once"),
        ("snapkv:64,window=0", "the window and the buffer must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_sparsity(spec)
    with pytest.raises(ValueError, match="unknown KV compression 'h2o': expected one of snapkv, rkv"):
        parse_eviction("h2o:64")
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        SnapKV(448, buffer=128).validate(context=512)
