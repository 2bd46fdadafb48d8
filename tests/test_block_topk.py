"""Page selection against a one-position-at-a-time brute force written straight from DESIGN.md."""

import numpy as np
import pytest
import torch

from sparrow.stages.attention.block_topk import kept_page_mask, page_centroids
from sparrow.stages.core.definitions import validate_budget


def brute_force_pages(q, keys, t, budget, page=16):
    """q [Hq, D], keys [Hkv, t+1, D] -> set of kept pages per KV head, by the definition."""
    hq, hkv = q.shape[0], keys.shape[0]
    n_pages = t // page + 1
    out = []
    for h in range(hkv):
        if budget == 0 or n_pages <= budget // page:
            out.append(set(range(n_pages)))
            continue
        qm = q[h * (hq // hkv):(h + 1) * (hq // hkv)].double().mean(0)
        last = t // page
        scored = []
        for j in range(1, last - 1):
            centroid = keys[h, j * page:(j + 1) * page].double().mean(0)
            scored.append((float(qm @ centroid), j))
        scored.sort(reverse=True)
        keep = {0, last - 1, last} | {j for _, j in scored[: budget // page - 3]}
        out.append(keep)
    return out


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 1, 32), (2, 2, 8)])
def test_selection_equals_brute_force(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + d)
    b, s = 3, 200
    keys = torch.randn(b, hkv, s, d, generator=g)
    q = torch.randn(b, hq, s, d, generator=g)
    positions = torch.arange(s).expand(b, s)
    budgets = torch.tensor([48, 64, 112])[:, None].expand(b, s).clone()
    budgets[2, :50] = 0  # dense queries mixed in
    centroids = page_centroids(keys)
    got = kept_page_mask(q, centroids, positions, budgets)
    for bi in range(b):
        for t in range(0, s, 7):
            expected = brute_force_pages(q[bi, :, t], keys[bi, :, : t + 1], t, int(budgets[bi, t]))
            for h in range(hkv):
                assert set(np.flatnonzero(got[bi, h, t].numpy())) == expected[h], (bi, t, h)


def test_centroids_of_partial_last_page():
    keys = torch.arange(2 * 1 * 37 * 2, dtype=torch.float64).view(2, 1, 37, 2)
    c = page_centroids(keys)
    assert c.shape == (2, 1, 3, 2)
    assert torch.allclose(c[:, :, 2], keys[:, :, 32:].mean(2))
    assert torch.allclose(c[:, :, 1], keys[:, :, 16:32].mean(2))


@pytest.mark.parametrize("bad", [40, 32, 0, 17])
def test_bad_budgets(bad):
    with pytest.raises(ValueError):
        validate_budget(bad)
