"""Teacher-forced sparse scoring against incremental sparse decoding (the central invariant)."""

import numpy as np
import pytest
import torch

from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import budget_fn
from sparrow.stages.engine import SamplingParams
from sparrow.stages.model.loading import load_model
from sparrow.stages.scoring.generate import sample
from sparrow.stages.scoring.mismatch import score_sequences


def _check_tf_equals_decode(model, prompts, sampler, max_new, tol, dense_layers=(0, 1)):
    budget_at = budget_fn(sampler)
    gens = sample(model, prompts, SamplingParams(max_new_tokens=max_new, seed=3), budget_at,
                  dense_layers=dense_layers)
    completions = [g.tokens for g in gens]
    scored = score_sequences(model, prompts, completions, [budget_at], dense_layers=dense_layers)
    _, logp_sparse = scored.sparse[budget_at]
    decoded = np.concatenate([g.logprobs for g in gens])
    assert np.abs(logp_sparse - decoded).max() <= tol
    return scored, gens


def test_tiny_teacher_forced_equals_decode_fixed_budget_and_schedule():
    m = load_model("tiny-qwen3").model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 97, 210)]
    scored, _ = _check_tf_equals_decode(m, prompts, "budget:64", 60, 1e-4, dense_layers=(0,))
    alpha = scored.sparse[next(iter(scored.sparse))][0]
    assert alpha.min() < 0.999  # sparsity actually changed something
    schedule = Schedule((0, 160, 240), (48, 80, 128))
    _check_tf_equals_decode(m, prompts, schedule, 60, 1e-4, dense_layers=())


def test_full_budget_is_dense_on_smollm2(smollm2):
    tok = smollm2.tokenizer
    prompt = tok("The sparrow is a small bird that " * 20).input_ids
    gens = sample(smollm2.model, [prompt], SamplingParams(max_new_tokens=24), None)
    scored = score_sequences(smollm2.model, [prompt], [gens[0].tokens], [1024])
    alpha, logp_sparse = scored.sparse[1024]
    assert np.all(np.abs(alpha - 1) <= 1e-5)
    assert np.abs(logp_sparse - scored.logp_dense).max() <= 1e-5
    assert np.abs(scored.logp_dense - np.array(gens[0].logprobs)).max() <= 1e-4


@pytest.mark.parametrize("sampler", ["budget:96", Schedule((0, 400), (64, 128))])
def test_smollm2_teacher_forced_equals_decode(smollm2, sampler):
    tok = smollm2.tokenizer
    text = " ".join(f"key{i} = {i * 37 % 101};" for i in range(60)) + " What is key7?"
    prompt = tok(text).input_ids
    assert len(prompt) > 300
    scored, gens = _check_tf_equals_decode(smollm2.model, [prompt, prompt[:250]], sampler, 40, 1e-4)
    alpha = scored.sparse[next(iter(scored.sparse))][0]
    assert alpha.min() < 0.99


def test_ragged_batch_scores_like_one_at_a_time():
    """Short prompt + short completion next to long ones (padding must not collide with real slots)."""
    m = load_model("tiny-qwen3").model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (60, 200, 130)]
    completions = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (10, 90, 40)]
    batched = score_sequences(m, prompts, completions, [48, 96], dense_layers=(0,))
    singles = [score_sequences(m, [p], [c], [48, 96], dense_layers=(0,))
               for p, c in zip(prompts, completions)]
    assert np.array_equal(batched.position, np.concatenate([s.position for s in singles]))
    for k in (48, 96):
        for i in (0, 1):
            expected = np.concatenate([s.sparse[k][i] for s in singles])
            assert np.abs(batched.sparse[k][i] - expected).max() <= 1e-4
    assert np.abs(batched.logp_dense - np.concatenate([s.logp_dense for s in singles])).max() <= 1e-4


class _DraftOverDenseKV:
    """A speculative draft's attention from the definition, one query at a time: the query at position t
    of a sparse layer keeps the pages block top-k keeps over the cache's dense keys at positions <= t
    (the first page, the two most recent, and the best others by mean(query heads of the group) .
    centroid_j, the mean of page j's keys; dense when the cache holds at most budget / 16 pages), then
    exact softmax attention over the kept positions. Writes nothing to the cache."""

    def __init__(self, budget: int, dense_layers=(0,), page: int = 16):
        self.budget, self.dense_layers, self.page = budget, set(dense_layers), page

    def __call__(self, layer, q, k, v, ctx):
        t = int(ctx.positions[0, 0])
        keys, values = ctx.cache.k[layer, 0, :, : t + 1].double(), ctx.cache.v[layer, 0, :, : t + 1].double()
        hkv, group = keys.shape[0], q.shape[1] // keys.shape[0]
        pages = -(-(t + 1) // self.page)
        out = torch.empty(q.shape[1], q.shape[-1], dtype=torch.float64)
        for h in range(hkv):
            qh = q[0, h * group: (h + 1) * group, 0].double()  # [group, D]
            kept = set(range(pages))
            if layer not in self.dense_layers and pages > self.budget // self.page:
                kept = {0, pages - 1, pages - 2}
                score = {j: float(qh.mean(0) @ keys[h, j * self.page: (j + 1) * self.page].mean(0))
                         for j in range(1, pages - 2)}
                kept |= set(sorted(score, key=lambda j: (-score[j], j))[: self.budget // self.page - 3])
            at = torch.tensor([p for p in range(t + 1) if p // self.page in kept])
            weights = torch.softmax(qh @ keys[h, at].T / q.shape[-1] ** 0.5, -1)
            out[h * group: (h + 1) * group] = weights @ values[h, at]
        return out[None, :, None].to(q.dtype)


def test_draft_alpha_is_each_query_alone_over_the_dense_kv():
    """`drafts=True`: at every completion position the sparse query reads the dense pass's keys and
    values (what a speculative cycle's drafts read), its alpha the same as one query at a time over a
    dense cache under the block top-k rule written out above; it differs from the lossy alpha."""
    from sparrow.stages.model.llama import KVCache

    m = load_model("tiny-qwen3", dtype=torch.float32).model
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (130,), generator=g).tolist()
    completion = torch.randint(3, 512, (40,), generator=g).tolist()
    # no dense layer: a later layer's keys depend on an earlier sparse layer's output, so the lossy pass's
    # own keys differ from the dense ones the drafts read
    scored = score_sequences(m, [prompt], [completion], [48], dense_layers=(), drafts=True)
    seq = prompt + completion
    cache = KVCache.allocate(m.cfg, 1, len(seq), torch.float32, "cpu")
    with torch.no_grad():
        m.hidden_states(torch.tensor([seq]), cache, positions=torch.arange(len(seq))[None])
        dense = torch.log_softmax(m.logits(m.hidden_states(torch.tensor([seq]))[0]).double(), -1)
        for j in range(1, len(completion)):
            t = len(prompt) + j - 1  # the query that predicts completion token j
            h = m.hidden_states(torch.tensor([[seq[t]]]), cache, positions=torch.tensor([[t]]),
                                attention=_DraftOverDenseKV(48, dense_layers=()))
            q = torch.softmax(m.logits(h[0, 0]).double(), -1)
            want = torch.minimum(dense[t].exp(), q).sum().item()
            assert scored.draft[48][j] == pytest.approx(want, abs=2e-5)
    assert scored.draft[48][0] == pytest.approx(1.0, abs=1e-5)  # the first token: the dense prefill's
    assert np.abs(scored.draft[48] - scored.sparse[48][0]).max() > 1e-3
