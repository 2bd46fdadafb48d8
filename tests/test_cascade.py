"""Cascade (shared-prefix) decode attention, kernels/cascade_decode.py, and the engine that uses it.

Independent references: brute-force float64 softmax attention over each row's tokens, read position by
position through the block table; and the engine without cascade (the plain paged path, which the
rollout tests check against transformers and teacher-forced scoring).
"""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.cascade_decode import cascade_decode_reference, suffix_pages
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.block_manager import BlockManager

P, HKV, G, D = 4, 2, 3, 8


def brute_force(q, k_pages, v_pages, table, seq_lens, scale):
    """float64, one row and head at a time, positions 0..seq_len-1 through the block table."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        phys = [int(table[b, t // P]) for t in range(n)]
        for h in range(q.shape[1]):
            keys = torch.stack([k_pages[p, h // G, t % P] for t, p in enumerate(phys)]).double()
            vals = torch.stack([v_pages[p, h // G, t % P] for t, p in enumerate(phys)]).double()
            w = torch.softmax(keys @ q[b, h].double() * scale, 0)
            out[b, h] = w @ vals
    return out


def shared_batch(dtype):
    """Two prompts: rows 0-2 share prompt A's 5 full pages, rows 3-4 share prompt B's 2, row 5 shares
    none; every row then has its own pages (copied partial page + generated tokens)."""
    g = torch.Generator().manual_seed(0)
    total = 64
    k_pages = torch.randn(total, HKV, P, D, generator=g).to(dtype)
    v_pages = torch.randn(total, HKV, P, D, generator=g).to(dtype)
    k_pages[40:] = float("nan")  # never-written pages: must not leak into any output
    v_pages[40:] = float("nan")
    prefix_a, prefix_b = [3, 4, 5, 6, 7], [10, 11]
    own = [[20, 21], [22], [23, 24, 25], [26], [27, 28], [30, 31, 32]]
    tables = [prefix_a + own[0], prefix_a + own[1], prefix_a + own[2], prefix_b + own[3], prefix_b + own[4],
              own[5]]
    seq_lens = torch.tensor([5 * P + 6, 5 * P + 1, 5 * P + 9, 2 * P + 3, 2 * P + 8, 3 * P - 1],
                            dtype=torch.int32)
    width = max(map(len, tables)) + 1  # one -1 column past every row
    table = torch.full((6, width), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t)
    q = torch.randn(6, HKV * G, D, generator=g).to(dtype)

    def contiguous(pages):  # what the engine copies at prefill: [Hkv, m*P, D]
        return (k_pages[pages].transpose(0, 1).reshape(HKV, -1, D),
                v_pages[pages].transpose(0, 1).reshape(HKV, -1, D))

    groups = [(torch.tensor([0, 1, 2]), *contiguous(prefix_a)), (torch.tensor([3, 4]), *contiguous(prefix_b))]
    first = [5, 5, 5, 2, 2, 0]
    n_pages = [-(-int(n) // P) for n in seq_lens]
    return q, k_pages, v_pages, table, seq_lens, groups, suffix_pages(first, n_pages, HKV)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cascade_equals_brute_force_attention(dtype, tol):
    q, k_pages, v_pages, table, seq_lens, groups, suffix = shared_batch(dtype)
    scale = D ** -0.5
    out = cascade_decode_reference(q, groups, k_pages, v_pages, table, seq_lens, suffix, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = brute_force(q, k_pages, v_pages, table, seq_lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_suffix_pages_pads_each_row():
    pages = suffix_pages([5, 2, 0], [7, 3, 2], hkv=2)
    assert pages.shape == (3, 2, 2)
    assert pages[:, 0].tolist() == [[5, 6], [2, -1], [0, 1]]


@pytest.mark.parametrize("sparsity,chunks", [(None, None), (64, None), (None, 4)])
def test_engine_with_cascade_matches_engine_without(smollm2, sparsity, chunks, monkeypatch):
    """Same tokens and logprobs within fp32 rounding, for 2 prompts x 3 samples at T=1 (groups of 3),
    a single-sample prompt (no sharing), and a budget (the dense layers cascade, the sparse ones not);
    `chunks`: the prefix attended in that many key chunks (short prompts get 1 otherwise)."""
    if chunks:
        import sparrow.kernels.cascade_decode as cascade

        monkeypatch.setattr(cascade, "key_chunks", lambda hkv, length: chunks if length % chunks == 0 else 1)
    model = smollm2.model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (150, 97)]
    params = [SamplingParams(max_new_tokens=12, n=3, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=12, n=1, temperature=1.0, seed=3, ignore_eos=True)]
    runs = []
    for cascade in (True, False):
        engine = Engine(model, as_policy(sparsity), EngineConfig(max_batch=8, cascade=cascade))
        runs.append(engine.generate(prompts, params))
        assert not engine.runner.prefixes  # every store is released when its request's samples finish
    for with_c, without in zip(*runs):
        for a, b in zip(with_c, without):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_cascade_page_scores_equal_the_reference_scores():
    from sparrow.kernels.cascade_decode import cascade_page_scores
    from sparrow.kernels.page_scoring import page_scores_reference

    q, k_pages, _, table, seq_lens, groups, suffix = shared_batch(torch.float32)
    centroids = torch.randn(k_pages.shape[0], HKV, D)
    prefixes = [(rows, centroids[table[rows[0], : pk.shape[1] // P].long()]) for rows, pk, _ in groups]
    got = cascade_page_scores(q, prefixes, centroids, table, seq_lens, suffix, P)
    ref = page_scores_reference(q, centroids, table, seq_lens, P)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_prefix_attention_in_key_chunks_equals_brute_force(chunks):
    """The prefix cut into key chunks, merged by log-sum-exp: the same attention and lse as float64."""
    from sparrow.kernels.cascade_decode import key_chunks, prefix_attention

    g = torch.Generator().manual_seed(2)
    n, s = 3, 64
    q = torch.randn(n, HKV * G, D, generator=g)
    k, v = torch.randn(HKV, s, D, generator=g), torch.randn(HKV, s, D, generator=g)
    out, lse = prefix_attention(q, k, v, 0.3, chunks=chunks)
    heads = torch.arange(HKV * G) // G
    logits = torch.einsum("nhd,hsd->nhs", q.double(), k.double()[heads]) * 0.3
    want = torch.einsum("nhs,hsd->nhd", torch.softmax(logits, -1), v.double()[heads])
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert key_chunks(3, 6016, threads=2) == 4 and key_chunks(3, 1024, threads=2) == 2
    assert key_chunks(8, 6016, threads=2) == 1 and key_chunks(3, 6002, threads=2) == 2


def test_prefix_copy_lives_in_the_pool_and_is_given_back_before_a_preemption(smollm2):
    """The cascade's copy of a 150-token prompt's 9 full pages takes 9 pool pages in a row (its
    keys are a view of the pool); a pool too small for it and the samples' growth gives the copy back
    instead of preempting, and a pool that cannot spare it at admission runs without it. Tokens equal
    an engine without cascade in every case."""
    model = smollm2.model
    prompt = torch.randint(0, 1000, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_new_tokens=24, n=3, temperature=1.0, seed=3, ignore_eos=True)
    want = Engine(model, None, EngineConfig(max_batch=8, cascade=False)).generate([prompt], params)[0]
    for pages, copy_at_start, copy_at_end in ((None, True, True), (23, True, False), (20, False, False)):
        engine = Engine(model, None, EngineConfig(max_batch=8, cascade=True, num_pages=pages))
        engine.add_request(prompt, params)
        engine.step()  # the prefill: the prompt's 10 pages (the last one partial), and the copy's 9
        assert bool(engine.runner.prefixes) == copy_at_start
        if copy_at_start:
            prefix = engine.runner.prefixes[0]
            assert list(prefix.run) == list(range(10, 19)) and engine.blocks.used == 19
            pool = engine.runner.cache.k
            assert prefix.k[0].untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
        done, had_copy = [], []
        while engine.has_work():
            done += engine.step()[0]
            had_copy.append(bool(engine.runner.prefixes) or not engine.has_work())
        assert had_copy[-2] == copy_at_end and engine.stats.preemptions == 0
        assert [c.token_ids for c in sorted(done, key=lambda c: c.sample)] == [c.token_ids for c in want]
        assert engine.blocks.used == 0 and not engine.runner.prefixes


def test_allocate_run_takes_the_lowest_run_of_consecutive_free_pages():
    blocks = BlockManager(8, 16)
    held = [blocks.allocate() for _ in range(8)]
    blocks.free_pages([held[i] for i in (1, 2, 4, 5, 6)])
    assert blocks.allocate_run(4) is None
    assert blocks.allocate_run(3) == [4, 5, 6] and sorted(blocks.free) == [1, 2]
    assert blocks.allocate_run(2) == [1, 2] and blocks.num_free == 0
