"""Paged-KV ops (kernels/CONTRACT.md): torch references against a brute force written from DESIGN.md,
and every Triton kernel against its torch reference under the Triton interpreter.

The brute force works on contiguous per-request K/V, one request at a time, with
`block_topk.page_centroids` / `kept_page_mask` and plain softmax attention over the kept positions. The
paged caches are built with non-contiguous (shuffled) block tables, pages shared between requests and
lengths that are not multiples of the page size.
"""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels import ops
from sparrow.stages.attention.block_topk import kept_page_mask, kept_token_mask, page_centroids

P = 16


# ----------------------------------------------------------------------------------------------------
# Builders and brute force
# ----------------------------------------------------------------------------------------------------

class Cache:
    """A paged cache built from contiguous per-request keys/values (the ground truth)."""

    def __init__(self, lengths, hq, hkv, d, *, shared=None, seed=0, dtype=torch.float32, appended=0,
                 kernels=ops.TORCH, device="cpu"):
        """shared: (src, dst, n): request dst shares its n full leading pages with request src (same
        tokens, same physical pages). appended: the last `appended` tokens of each request go through
        append_kv (one token per request per step) instead of write_prefill."""
        g = torch.Generator().manual_seed(seed)
        b = len(lengths)
        self.lengths, self.hq, self.hkv, self.d, self.b = list(lengths), hq, hkv, d, b
        self.keys = [torch.randn(hkv, n, d, generator=g).to(dtype) for n in lengths]
        self.values = [torch.randn(hkv, n, d, generator=g).to(dtype) for n in lengths]
        src, dst, shared = shared or (0, -1, 0)
        if shared:
            assert lengths[src] >= shared * P and lengths[dst] > shared * P
            self.keys[dst][:, : shared * P] = self.keys[src][:, : shared * P]
            self.values[dst][:, : shared * P] = self.values[src][:, : shared * P]
        self.shared = (src, dst, shared)
        n_pages = [-(-n // P) for n in lengths]
        max_pages = max(n_pages) + 2  # spare columns stay -1
        total = sum(n_pages) + 7
        perm = torch.randperm(total, generator=g).tolist()  # non-contiguous physical pages
        self.block_table = torch.full((b, max_pages), -1, dtype=torch.int32)
        nxt = 0
        for i in sorted(range(b), key=lambda i: i == dst):  # the source gets its pages first
            for j in range(n_pages[i]):
                if i == dst and j < shared:
                    self.block_table[i, j] = self.block_table[src, j]
                else:
                    self.block_table[i, j] = perm[nxt]
                    nxt += 1
        self.k_pages = torch.full((total, hkv, P, d), float("nan"), dtype=dtype)  # unwritten = NaN
        self.v_pages = torch.full((total, hkv, P, d), float("nan"), dtype=dtype)
        self.centroids = torch.zeros(total, hkv, d)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32)
        # prefill: all tokens but the last `appended` (shared tokens written once, by request 0)
        slots, ks, vs = [], [], []
        for i in range(b):
            first = shared * P if i == dst else 0
            pre = max(first, lengths[i] - appended)
            pos = torch.arange(first, pre)
            slots.append(self.block_table[i, pos // P].long() * P + pos % P)
            ks.append(self.keys[i][:, first:pre].transpose(0, 1))
            vs.append(self.values[i][:, first:pre].transpose(0, 1))
        self.to(device)
        ops.write_prefill(self.k_pages, self.v_pages, self.centroids, torch.cat(ks).to(device),
                          torch.cat(vs).to(device), torch.cat(slots).to(device))
        for step in range(appended):
            slots, ks, vs = [], [], []
            for i in range(b):
                pre = lengths[i] - appended
                t = pre + step
                first = shared * P if i == dst else 0
                if t < first or t < 0:
                    slots.append(-1)  # padding row (skipped)
                    t = 0
                else:
                    slots.append(int(self.block_table[i, t // P]) * P + t % P)
                ks.append(self.keys[i][:, t])
                vs.append(self.values[i][:, t])
            kernels.append_kv(self.k_pages, self.v_pages, self.centroids, torch.stack(ks).to(device),
                              torch.stack(vs).to(device), torch.tensor(slots, device=device))
        self.q = torch.randn(b, hq, d, generator=g).to(dtype).to(device)

    def to(self, device):
        """Move the paged tensors (not the contiguous ground truth) to `device`."""
        for name in ("k_pages", "v_pages", "centroids", "block_table", "seq_lens", "q"):
            if hasattr(self, name):
                setattr(self, name, getattr(self, name).to(device))
        return self


def brute_selection(cache: Cache, budgets):
    """Per request, per KV head: the set of kept logical pages, from block_topk on contiguous keys."""
    out = []
    for i in range(cache.b):
        keys = cache.keys[i].float()[None]  # [1, Hkv, L, D]
        cent = page_centroids(keys, P)
        t = cache.lengths[i] - 1
        mask = kept_page_mask(cache.q[i].float().cpu()[None, :, None, :], cent, torch.tensor([[t]]),
                              torch.tensor([[int(budgets[i])]]), P)  # [1, Hkv, 1, n_pages]
        out.append([set(torch.nonzero(mask[0, h, 0]).flatten().tolist()) for h in range(cache.hkv)])
    return out


def brute_attention(cache: Cache, budgets, scale=None):
    """Exact softmax attention over the kept positions, one request and one query head at a time."""
    d = cache.d
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(cache.b, cache.hq, d, dtype=torch.float64)
    g = cache.hq // cache.hkv
    for i in range(cache.b):
        keys = cache.keys[i].float()[None]
        n = cache.lengths[i]
        cent = page_centroids(keys, P)
        pos = torch.tensor([[n - 1]])
        pages = kept_page_mask(cache.q[i].float()[None, :, None, :], cent, pos,
                               torch.tensor([[int(budgets[i])]]), P)
        tokens = kept_token_mask(pages, pos, n, P)[0, :, 0]  # [Hkv, n]
        for h in range(cache.hq):
            kv = h // g
            idx = torch.nonzero(tokens[kv]).flatten()
            k = cache.keys[i][kv, idx].double()
            v = cache.values[i][kv, idx].double()
            w = torch.softmax(scale * (k @ cache.q[i, h].double()), dim=0)
            out[i, h] = w @ v
    return out


def selected_sets(selected):
    return [[{int(p) for p in selected[i, h] if p >= 0} for h in range(selected.shape[1])]
            for i in range(selected.shape[0])]


# ----------------------------------------------------------------------------------------------------
# torch references vs brute force
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("appended", [0, 20])
def test_cache_writes_match_contiguous(appended):
    cache = Cache([5, 300, 37, 16], hq=4, hkv=2, d=16, appended=appended, seed=1)
    cache2 = Cache([70, 90], hq=4, hkv=2, d=16, shared=(0, 1, 3), appended=appended, seed=2)
    for c in (cache, cache2):
        for i, n in enumerate(c.lengths):
            pos = torch.arange(n)
            phys = c.block_table[i, pos // P].long()
            torch.testing.assert_close(c.k_pages[phys, :, pos % P].transpose(0, 1), c.keys[i])
            torch.testing.assert_close(c.v_pages[phys, :, pos % P].transpose(0, 1), c.values[i])
            want = page_centroids(c.keys[i][None], P)[0].transpose(0, 1)  # [n_pages, Hkv, D]
            got = c.centroids[c.block_table[i, : want.shape[0]].long()]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (4, 2, 32), (9, 3, 64), (8, 2, 16), (8, 1, 32)])
def test_select_pages_reference(hq, hkv, d):
    cache = Cache([5, 300, 130, 200, 17, 64], hq, hkv, d, shared=(2, 3, 5), seed=hq + d)
    budgets = torch.tensor([48, 64, 0, 112, 48, 512], dtype=torch.int32)
    sel = ops.CPU.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets)
    assert sel.dtype == torch.int32 and sel.shape[:2] == (6, hkv)
    assert sel.shape[2] == max(len(s) for per in brute_selection(cache, budgets) for s in per)
    for row in sel.reshape(-1, sel.shape[2]):  # sorted ascending, -1 padding at the end
        valid = row[row >= 0]
        assert torch.equal(valid, valid.sort().values) and bool((row[len(valid):] == -1).all())
    assert selected_sets(sel) == brute_selection(cache, budgets)
    # a fixed width (no host sync) pads with -1 and keeps the same pages
    wide = ops.CPU.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets,
                            max_selected=cache.block_table.shape[1])
    assert selected_sets(wide) == selected_sets(sel)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 32), (9, 3, 64), (8, 1, 16)])
def test_sparse_reference_vs_brute_force(hq, hkv, d):
    cache = Cache([5, 300, 130, 200, 17], hq, hkv, d, shared=(1, 2, 6), seed=3 * hq + d)
    budgets = torch.tensor([48, 64, 0, 112, 512], dtype=torch.int32)
    sel = ops.CPU.select_pages(cache.q, cache.centroids, cache.block_table, cache.seq_lens, budgets)
    out = ops.CPU.sparse_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                     cache.seq_lens, sel, scale=0.3)
    torch.testing.assert_close(out.double(), brute_attention(cache, budgets, scale=0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 32), (8, 1, 16)])
def test_dense_reference_vs_brute_force(hq, hkv, d):
    cache = Cache([5, 300, 16, 33], hq, hkv, d, shared=(1, 3, 2), seed=7 + d)
    out = ops.CPU.dense_paged_attention(cache.q, cache.k_pages, cache.v_pages, cache.block_table,
                                        cache.seq_lens)
    assert out.shape == (4, hq, d) and out.dtype == cache.q.dtype
    zeros = torch.zeros(4, dtype=torch.int32)
    torch.testing.assert_close(out.double(), brute_attention(cache, zeros), atol=1e-5, rtol=1e-5)


def test_dispatch():
    assert ops.ops_for("cpu") is ops.CPU and ops.ops_for("cpu", ops.Backend.TORCH) is ops.TORCH
