"""Exact speculative decoding (stages/engine/speculative.py): block top-k drafts, dense verification.

The references are independent of the engine: the rule's output distribution against the target computed
in closed form, the engine's samples against the dense distribution that transformers' model gives by
enumeration, greedy tokens against the dense engine's, logprobs against teacher-forced dense scoring.
Each engine test runs the drafts on both decode steps: plain (host draws) and static (the device's draws,
the step a GPU replays from CUDA graphs, here run eagerly).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from no_host_sync import no_host_sync

from sparrow.stages.attention import SparseAttention
from sparrow.stages.attention.block_topk import kept_page_mask, kept_token_mask, page_centroids
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams, speculative
from sparrow.stages.engine.config import DecodeStep
from sparrow.stages.engine.speculative import accept_or_resample, accept_or_resample_batch
from sparrow.stages.engine.static_decode import SCORE
from sparrow.stages.kv_policies import SnapKV
from sparrow.stages.model.llama import KVCache
from sparrow.stages.model.loading import load_model
from sparrow.stages.speculative_plan import expected_tokens

from tiny_models import tiny_qwen3

SPARSE = dict(dense_layers=(0,))  # layers 1-2 sparse: the drafts differ from dense
STEPS = pytest.mark.parametrize("step", [DecodeStep.PLAIN, DecodeStep.EAGER], ids=["plain", "static"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-spec")
    hf = tiny_qwen3(path)
    return hf, load_model(str(path)).model


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities, cells with an expectation under 5 pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.0, 0.3, 0.9, 0.99):
        for k in (0, 1, 4):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5


def test_the_rule_draws_from_the_target():
    """Drafts from q, the rule's output from p, whatever q is (one draft, then two)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)
    n = 20000
    first = torch.zeros(6)
    second = torch.zeros(36)
    for _ in range(n):
        d1 = int(torch.multinomial(q[0], 1, generator=g))
        kept, nxt = (int(x) for x in accept_or_resample(p[:2], q[:1], torch.tensor([d1]), g))
        first[d1 if kept else nxt] += 1
    assert _chi2_pvalue(first, p[0]) > 1e-3
    # two drafts with p's second row conditioned on the first token being kept: a fixed p[1] for every
    # prefix makes the pair's law p[0] x p[1]
    for _ in range(n):
        d = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        kept, nxt = (int(x) for x in accept_or_resample(p, q, torch.tensor(d), g))
        a = d[0] if kept >= 1 else nxt
        if kept == 0:  # the cycle emitted one token; the next comes from p[1] as the next cycle's would
            b = int(torch.multinomial(p[1], 1, generator=g))
        else:
            b = d[1] if kept == 2 else nxt
        second[a * 6 + b] += 1
    assert _chi2_pvalue(second, torch.outer(p[0], p[1]).flatten()) > 1e-3


def test_the_batched_rule_is_the_per_sample_rule():
    """Samples with 0 to K drafts, greedy and sampled, in one batch: each gets the tokens the one-sample
    rule (whose law the test above checks) gives from the same generator state."""
    g = torch.Generator().manual_seed(4)
    K, V = 3, 7
    counts = [3, 0, 2, 1, 3, 3]
    p = torch.softmax(torch.randn(len(counts), K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(len(counts), K + 1, V, generator=g) * 2, -1)
    p[3, 0] = torch.nn.functional.one_hot(torch.tensor(2), V).float()  # a greedy sample's rows are one-hot
    p[3, 1] = torch.nn.functional.one_hot(torch.tensor(5), V).float()
    drafts = torch.randint(V, (len(counts), K), generator=g)
    drafts[3, 0] = 2
    for i, n in enumerate(counts):
        q[i, n:] = 0
    for trial in range(200):
        seeds = [100 * trial + i for i in range(len(counts))]
        gens = [None if i == 3 else torch.Generator().manual_seed(s) for i, s in enumerate(seeds)]
        kept, nxt = accept_or_resample_batch(p, q, drafts, counts, gens)
        for i, n in enumerate(counts):
            ref_gen = None if i == 3 else torch.Generator().manual_seed(seeds[i])
            want = accept_or_resample(p[i, : n + 1], q[i, :n], drafts[i, :n], ref_gen)
            assert (int(kept[i]), int(nxt[i])) == tuple(int(x) for x in want), (trial, i)


def _dense_joint(hf, prompt: list[int], steps: int, top_k: int) -> dict[tuple[int, ...], float]:
    """The dense model's law of the first `steps` tokens under top-k sampling, by enumeration."""
    law = {(): 1.0}
    for _ in range(steps):
        prefixes = list(law)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1].double()
        probs = torch.softmax(logits, -1)
        top = probs.topk(top_k, -1)
        nxt = {}
        for x, vals, ids in zip(prefixes, top.values, top.indices):
            vals = vals / vals.sum()
            for v, i in zip(vals.tolist(), ids.tolist()):
                nxt[x + (i,)] = law[x] * v
        law = nxt
    return law


@STEPS
def test_speculative_samples_follow_the_dense_law(tiny, step):
    """2,000 samples of 4 tokens with top-k 3: their joint law equals dense's (27 x 3 cells), and the
    sparse drafts were rejected often enough for the test to mean something."""
    hf, model = tiny
    prompt = _prompts([200])[0]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, n=2000, ignore_eos=True, seed=3)
    config = EngineConfig(speculate=3, max_batch=64, decode_step=step, **SPARSE)
    with Engine(model, as_policy(48), config) as engine:
        samples = engine.generate([prompt], params)[0]
        drafted, kept = engine.stats.drafted_tokens, engine.stats.accepted_drafts
    assert 0.2 < kept / drafted < 0.9
    law = _dense_joint(hf, prompt, 4, 3)
    cells = sorted(law)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for c in samples:
        counts[index[tuple(c.token_ids)]] += 1  # a sequence outside dense's top-k support would raise
    assert _chi2_pvalue(counts, torch.tensor([law[c] for c in cells])) > 1e-3


@pytest.mark.parametrize("sparsity,k,step", [(48, 4, DecodeStep.PLAIN), (64, 2, DecodeStep.PLAIN),
                                             (48, 3, DecodeStep.EAGER)])
def test_greedy_speculation_gives_the_dense_greedy_tokens(tiny, sparsity, k, step):
    _, model = tiny
    prompts = _prompts([70, 150, 260, 33])
    params = SamplingParams(max_new_tokens=40, temperature=0.0, n=2, ignore_eos=True)
    with Engine(model, None, EngineConfig(**SPARSE)) as engine:
        dense = engine.generate(prompts, params)
    config = EngineConfig(speculate=k, max_batch=5, decode_step=step, **SPARSE)
    with Engine(model, as_policy(sparsity), config) as engine:
        spec = engine.generate(prompts, params)
        assert engine.blocks.used == 0 and not any(engine.blocks.refcount)
    for a, b in zip(dense, spec):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
            assert set(y.budgets) == {0}
            assert len(y.accepted) == len(y.token_ids) and not y.accepted[0]
            assert sum(y.accepted) <= y.drafted


@STEPS
def test_logprobs_are_the_dense_models_and_pages_come_back(tiny, step):
    """At temperature 1 the returned logprobs equal transformers' teacher-forced dense ones; a pool too
    small for every sample preempts and recomputes, and no page leaks."""
    hf, model = tiny
    prompts = _prompts([120, 230])
    # top-k 3 makes the drafts' law differ enough from dense's that some are rejected; the logprobs are
    # reported before truncation, as transformers' log-softmax
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_k=3, n=3, ignore_eos=True, seed=5)
    config = EngineConfig(speculate=3, num_pages=30, decode_step=step, **SPARSE)
    with Engine(model, as_policy(48), config) as engine:
        out = engine.generate(prompts, params)
        assert engine.stats.preemptions > 0
        assert engine.stats.accepted_drafts < engine.stats.drafted_tokens
        assert engine.blocks.used == 0
    for prompt, group in zip(prompts, out):
        for c in group:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1: -1]
            dense = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])
            assert list(c.logprobs) == pytest.approx(dense[:, 0].tolist(), abs=2e-4)


def test_speculation_is_refused_where_it_cannot_run(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="speculate must be >= 0"):
        EngineConfig(speculate=-1)
    for bad in (1.5, True, "2"):
        with pytest.raises(ValueError, match="speculate must be a whole number of draft tokens per cycle"):
            EngineConfig(speculate=bad)
    with pytest.raises(ValueError, match="reuse_draft_pages must be True or False"):
        EngineConfig(speculate=2, reuse_draft_pages="no")
    with Engine(model, None, EngineConfig(speculate=2)) as engine:
        with pytest.raises(ValueError, match="eviction"):
            engine.add_request([5] * 40, SamplingParams(max_new_tokens=4), policy=SnapKV(32, window=8))


@STEPS
def test_seeded_speculation_repeats_whatever_the_batch(tiny, step):
    _, model = tiny
    prompts = _prompts([90, 180, 40])
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, ignore_eos=True, seed=11)
    runs = []
    for batch in (1, 6):
        config = EngineConfig(speculate=2, max_batch=batch, decode_step=step, **SPARSE)
        with Engine(model, as_policy(48), config) as engine:
            runs.append([[c.token_ids for c in g] for g in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert list(itertools.chain(*runs[0]))


def test_the_static_verification_scores_as_the_plain_forward(tiny):
    """On the static step the verification is one scoring step of one row per fed token, every sample's
    rows in it (more rows than the decode steps' largest bucket): at every cycle it gives the plain
    verification forward's log-probs and writes the same keys and values. And every full page before a
    cycle's first fed slot has the mean of its keys as centroid (the drafts' appends were undone)."""
    _, model = tiny
    prompts = _prompts([75, 140])
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=2, ignore_eos=True, seed=7)
    config = EngineConfig(speculate=3, max_batch=4, decode_step=DecodeStep.EAGER, **SPARSE)
    rows = []
    with Engine(model, as_policy(48), config) as engine:
        engine.reserve(prompts, params)
        runner = engine.runner
        static_verify = runner.verify
        steps = []
        score_step = runner.static._score
        runner.static._score = lambda n: (steps.append(n), score_step(n))

        def checked(seqs, starts):
            cache, P = runner.cache, runner.page_size
            for s, start in zip(seqs, starts):
                for i in range(start // P):
                    keys = cache.k[:, s.pages[i]].double()  # [L, Hkv, P, D]
                    assert torch.allclose(cache.centroids[:, s.pages[i]].double(), keys.mean(2), atol=1e-5)
            state = (cache.k, cache.v, cache.centroids)
            before = [t.clone() for t in state]
            steps.clear()
            scored = static_verify(seqs, starts)
            assert len(steps) == 1
            written = [t.clone() for t in state]
            for t, b in zip(state, before):
                t.copy_(b)
            fed = [(s.request.prompt + s.tokens)[start:] for s, start in zip(seqs, starts)]
            plain = torch.log_softmax(runner._verify_forward(seqs, starts, fed), dim=-1)
            assert torch.allclose(scored, plain, atol=1e-4)
            assert torch.allclose(cache.k, written[0], atol=1e-5)
            assert torch.allclose(cache.v, written[1], atol=1e-5)
            for t, w in zip(state, written):  # the run goes on from the static step's writes
                t.copy_(w)
            rows.append(sum(len(f) for f in fed))
            return scored

        runner.verify = checked
        out = engine.generate(prompts, params)
        assert engine.blocks.used == 0 and engine.stats.accepted_drafts < engine.stats.drafted_tokens
    assert max(rows) > config.max_batch and all(len(c.token_ids) == 24 for g in out for c in g)


class FirstDraftPages(SparseAttention):
    """The reference of a cycle's drafts on kept pages, from the definitions: the fed tokens of one cycle,
    teacher forced over a dense prefix; every query attends to the pages that block top-k keeps for the
    cycle's first query, its first page and its two most recent pages (its own position's)."""

    def attend(self, q, keys, values, positions):
        t, page = q.shape[2], self.page
        centroids = page_centroids(keys, page)
        first = kept_page_mask(q[:, :, :1].expand_as(q), centroids, positions[:, :1].expand(-1, t),
                               self.budgets.expand(1, t), page)
        index = torch.arange(centroids.shape[2])
        last = (positions // page)[:, None, :, None]
        own = (index == 0) | ((index >= last - 1) & (index <= last))
        mask = kept_token_mask(first | own, positions, keys.shape[2], page)
        mask = mask.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _draft_reference(model, prefix: list[int], drafts: list[int], budget: int,
                     rule: type[SparseAttention] = FirstDraftPages) -> torch.Tensor:
    """Log-probs of a cycle's draft steps [len(drafts), V], teacher forced under `rule`: step j feeds the
    cycle's token j (the prefix's last, then the drafts) over the prefix's dense keys."""
    fed = torch.tensor([prefix[-1:] + drafts[:-1]])
    c = len(prefix) - 1
    cache = KVCache.allocate(model.cfg, 1, c + fed.shape[1], torch.float32, "cpu")
    attention = rule(torch.tensor([[budget]]), dense_layers=SPARSE["dense_layers"])
    with torch.no_grad():
        model.hidden_states(torch.tensor([prefix[:-1]]), cache, positions=torch.arange(c)[None])
        positions = c + torch.arange(fed.shape[1])[None]
        h = model.hidden_states(fed, cache, positions=positions, attention=attention)
        return torch.log_softmax(model.logits(h[0]).double(), -1)


def _drafted_cycles(model, budget: int, config: EngineConfig, prompts, params) -> list[tuple]:
    """Every cycle's (prefix, drafts, the drafts' log q [n, V]) of one speculative rollout."""
    cycles = []
    decide = speculative._decide

    def recorded(drafting, logp):
        for c in filter(lambda c: c.drafts, drafting):  # a sample at its last token drafts nothing
            prefix = c.seq.request.prompt + c.seq.tokens[: c.generated]
            cycles.append((prefix, list(c.drafts), torch.stack(c.probs).double().log()))
        return decide(drafting, logp)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative, "_decide", recorded)
        with Engine(model, as_policy(budget), config) as engine:
            engine.generate(prompts, params)
    return cycles


@pytest.mark.parametrize("budget", [48, 80])
def test_later_drafts_attend_to_the_first_drafts_pages(tiny, budget):
    """On the static step a cycle's later drafts attend to the pages its first draft kept (and the pages
    their own positions reserve), which teacher-forced scoring under that rule reproduces at every draft,
    cycles that cross into a new page included; the samples stay exact (greedy: dense greedy's tokens)."""
    _, model = tiny
    prompts = _prompts([150, 231])
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=2, ignore_eos=True, seed=3)
    config = EngineConfig(speculate=4, max_batch=4, decode_step=DecodeStep.EAGER, **SPARSE)
    cycles = _drafted_cycles(model, budget, config, prompts, params)
    crossing = 0
    for prefix, drafts, logq in cycles:
        ref = _draft_reference(model, prefix, drafts, budget)
        assert torch.allclose(logq.exp(), ref.exp(), atol=1e-5)
        crossing += (len(prefix) - 1) // 16 != (len(prefix) + len(drafts) - 2) // 16
    assert crossing >= 4 and len(cycles) >= 20
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, n=1, ignore_eos=True)
    with Engine(model, None, EngineConfig(**SPARSE)) as engine:
        dense = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    with Engine(model, as_policy(budget), config) as engine:
        assert [g[0].token_ids for g in engine.generate(prompts, greedy)] == dense


def test_drafts_select_at_every_step_without_reuse(tiny):
    """With `reuse_draft_pages` off the static step's drafts are the lossy sampler's: each draft's law is
    teacher-forced block top-k at its own position, which at some cycles differs from the law on the first
    draft's pages."""
    _, model = tiny
    params = SamplingParams(max_new_tokens=30, temperature=1.0, n=2, ignore_eos=True, seed=3)
    config = EngineConfig(speculate=4, max_batch=2, decode_step=DecodeStep.EAGER, reuse_draft_pages=False,
                          **SPARSE)
    differ = 0
    for prefix, drafts, logq in _drafted_cycles(model, 80, config, _prompts([150]), params):
        ref = _draft_reference(model, prefix, drafts, 80, SparseAttention)
        assert torch.allclose(logq.exp(), ref.exp(), atol=1e-5)
        differ += not torch.allclose(logq.exp(), _draft_reference(model, prefix, drafts, 80).exp(), atol=1e-5)
    assert differ > 0


_TRITON_SCRIPT = """
import sys, torch
from dataclasses import replace
from sparrow.kernels.ops import Backend
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.config import DecodeStep
from sparrow.stages.model.loading import load_model
sys.path.insert(0, sys.argv[2])
from tiny_models import tiny_qwen3
tiny_qwen3(sys.argv[1])
model = load_model(sys.argv[1]).model
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 141)]
params = SamplingParams(max_new_tokens=24, n=2, temperature=0.0, ignore_eos=True)
config = EngineConfig(max_batch=4, dense_layers=(0,), kernels=Backend.TORCH)
ref = Engine(model, None, config).generate(prompts, params)
for step in (DecodeStep.PLAIN, DecodeStep.EAGER):
    triton = replace(config, kernels=Backend.TRITON, speculate=3, decode_step=step)
    engine = Engine(model, as_policy(48), triton)
    got = engine.generate(prompts, params)
    assert engine.blocks.used == 0 and engine.stats.drafted_tokens > 0
    assert (engine.runner.static is None) == (step == DecodeStep.PLAIN)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids, (step, x.token_ids, y.token_ids)
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
# greedy drafts on kept pages (budget 80 keeps two scored pages): the Triton kernels' draft log-probs are
# the torch path's, step after step
from sparrow.stages.engine import speculative
drafted = {}
take = speculative._take_drafts
for kernels in (Backend.TORCH, Backend.TRITON):
    speculative._take_drafts = lambda active, logp, tokens, rows=drafted.setdefault(kernels, []): (
        rows.append(logp), take(active, logp, tokens))[1]
    spec = replace(config, kernels=kernels, speculate=4, decode_step=DecodeStep.EAGER)
    Engine(model, as_policy(80), spec).generate(prompts, params)
a, b = (torch.cat(drafted[k]) for k in (Backend.TORCH, Backend.TRITON))
assert a.shape == b.shape and (a - b).abs().max() < 1e-4, (a - b).abs().max()
print("ok", engine.stats.accepted_drafts, engine.stats.drafted_tokens)
"""


@pytest.mark.slow
def test_speculation_on_the_gpu_runner_under_the_interpreter(tmp_path):
    """The GPU runner's path (Triton decode kernels for the drafts and the verification's queries; drafts
    on the plain step and on the static step that a GPU captures) through Triton's interpreter: greedy
    speculation gives the torch path's dense greedy tokens, and drafts on kept pages are the torch path's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = [sys.executable, "-c", _TRITON_SCRIPT, str(tmp_path / "tiny"), str(Path(__file__).parent)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and r.stdout.strip().startswith("ok"), r.stderr[-3000:]


@STEPS
def test_stop_tokens_inside_the_drafts(tiny, step):
    """A stop token drafted, kept or drawn ends the sample where dense greedy decoding ends it."""
    _, model = tiny
    prompts = _prompts([60, 130, 210])
    params = SamplingParams(max_new_tokens=40, temperature=0.0, n=1, ignore_eos=True)
    with Engine(model, None, EngineConfig(**SPARSE)) as engine:
        free = engine.generate(prompts, params)
    # stop at a token each greedy continuation reaches somewhere in its middle
    stops = tuple({c.token_ids[len(c.token_ids) // 2] for group in free for c in group})
    params = SamplingParams(max_new_tokens=40, temperature=0.0, n=1)
    runs = []
    for spec, k in ((None, 0), (48, 3)):
        config = EngineConfig(eos_ids=stops, speculate=k, decode_step=step, **SPARSE)
        with Engine(model, None if spec is None else as_policy(spec), config) as engine:
            runs.append(engine.generate(prompts, params))
            assert engine.blocks.used == 0
    for a, b in zip(*runs):
        assert a[0].token_ids == b[0].token_ids and a[0].finish_reason == b[0].finish_reason == "stop"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_speculation_with_cuda_graphs_equals_the_eager_static_step():
    """On a GPU (bf16, Triton kernels): drafts and verifications replayed from CUDA graphs give the eager
    static step's cycles exactly (tokens, logprobs, acceptance), greedy and sampled with top-p, under a
    schedule."""
    from sparrow.stages.core.schedule import Schedule

    model = load_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, random_weights=True).model
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (150, 97, 210)]
    policy = as_policy(Schedule((0, 160, 240), (48, 80, 128)))
    greedy = SamplingParams(max_new_tokens=24, n=3, temperature=0.0, ignore_eos=True)
    for params in (greedy, SamplingParams(max_new_tokens=24, n=2, seed=3, temperature=0.8, top_p=0.9,
                                          ignore_eos=True)):
        runs = []
        for step in (DecodeStep.EAGER, DecodeStep.GRAPHS):
            with Engine(model, policy, EngineConfig(max_batch=5, speculate=3, decode_step=step)) as engine:
                out = engine.generate(prompts, params)
                assert step == DecodeStep.EAGER or {k for _, k, _ in engine.runner.static.graphs} > {SCORE}
                assert engine.blocks.used == 0 and engine.stats.drafted_tokens > 0
                runs.append([c for group in out for c in group])
        for a, b in zip(*runs):
            assert a.token_ids == b.token_ids and a.accepted == b.accepted
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_speculative_cycles_run_without_host_synchronisation():
    """On a GPU, once a cycle's graphs are captured, the host waits on the device only through events
    (each draft step's read-back, the cycle's one read of the rule's outcome, the verification's timing):
    no implicit synchronisation (torch's sync debug mode raises on one: .item(), .tolist() of a device
    tensor, pageable copies) and no torch.cuda.synchronize, sampled with top-p and top logprobs; the
    tokens are the eager static step's."""
    model = load_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, random_weights=True).model
    prompts = _prompts((300, 170))
    params = [SamplingParams(max_new_tokens=64, n=3, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=64, n=2, seed=2, temperature=0.8, top_p=0.9, logprobs=2,
                             ignore_eos=True)]
    policy = as_policy(48)
    eager = EngineConfig(max_batch=8, speculate=3, decode_step=DecodeStep.EAGER)
    want = [c for group in Engine(model, policy, eager).generate(prompts, params) for c in group]
    engine = Engine(model, policy, EngineConfig(max_batch=8, speculate=3))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=i)
    done = []
    for _ in range(3):  # the prefill and the first cycles (graph capture)
        done += engine.step()[0]
    with no_host_sync("a speculative cycle"):
        for _ in range(6):  # at most 6 x 4 tokens more: every cycle drafts its full K
            done += engine.step()[0]
    while engine.has_work():
        done += engine.step()[0]
    got = sorted(done, key=lambda c: (c.request_id, c.sample))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    assert engine.blocks.used == 0 and engine.stats.drafted_tokens > 0
