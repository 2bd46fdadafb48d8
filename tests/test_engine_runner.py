"""The engine over its device runner (stages/engine/runner.py, cpu_runner.py, memory.py): memory, chunked
prefill, one engine for many runs.

Independent references: the scheduler itself driven without a model (the most pages a workload ever
holds, against the pool size formula), a one-shot prefill and teacher-forced scoring (`score_sequences`)
against chunked prefills, freshly built engines against a reused one, and weak references against
the claim that an engine's memory goes when it is closed or dropped (no reference cycle).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from sparrow.cli.app import app
from sparrow.kernels.ops import Backend
from sparrow.stages.attention.kv_cache import PagedKVCache
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import as_policy, budget_fn
from sparrow.stages.engine import DecodeStep, Engine, EngineConfig, SamplingParams
from sparrow.stages.engine.block_manager import BlockManager
from sparrow.stages.engine.memory import GiB, PoolTooSmall, Workload, pool_pages
from sparrow.stages.engine.runner import ModelRunner, plan_forwards
from sparrow.stages.engine.scheduler import Scheduler
from sparrow.stages.engine.sequence import Request, Sequence
from sparrow.stages.kv_policies import Dense
from sparrow.stages.model.loading import load_model, resolve_config
from sparrow.stages.scoring.mismatch import score_sequences

from cli_checks import error_line
from tiny_models import tiny_qwen3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-runner")
    tiny_qwen3(path, max_position_embeddings=1024)
    return load_model(str(path)).model


def _prompts(lengths, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _same(a, b, tol=0.0):
    for x, y in zip(a, b):
        for c, d in zip(x, y):
            assert c.token_ids == d.token_ids and c.budgets == d.budgets
            assert np.abs(np.array(c.logprobs) - np.array(d.logprobs)).max(initial=0.0) <= tol


# ---------------------------------------------------------------------------- the pool's size


def _drive(requests, max_batch, pool=100_000, page=16, copies=False):
    """Drive the scheduler as the engine drives it, without a model, over `requests` (prompt, n, max_new)
    in a pool of `pool` pages: a prefill allocates each entry's pages, then (cascade) a copy of each
    fresh prompt's full pages while a page to grow into stays free for each sample that can run; a
    decode step appends a token to every running sample; finished samples give their pages back, a
    group's copy goes with its last sample. Returns (the most pages held at once, copies not taken,
    preemptions)."""
    blocks = BlockManager(pool, page)
    sched = Scheduler(blocks, max_batch, 10**9)
    for i, (p, n, m) in enumerate(requests):
        sched.add(Request(i, [1] * p, SamplingParams(max_new_tokens=m, n=n), Dense(), frozenset()))
    copy, left, peak, skipped = {}, {}, 0, 0

    def finish(s):
        sched.finish(s)
        rid = s.request.request_id
        if rid in left:
            left[rid] -= 1
            if not left[rid]:
                blocks.free_pages(copy.pop(rid))
                del left[rid]

    while sched.has_work():
        step = sched.schedule()
        kind, batch = step.kind, step.batch
        if kind == "decode":
            for s in batch:
                s.tokens.append(0)
                s.cached += 1
            peak = max(peak, blocks.used)
            for s in batch:
                if len(s.tokens) >= s.request.params.max_new_tokens:
                    finish(s)
            continue
        pages = [[blocks.allocate() for _ in range(blocks.pages_for(
            len(x.request.prompt) + len(x.tokens) - 1 if isinstance(x, Sequence) else len(x.prompt)))]
            for x in batch]
        for x in batch:
            full = len(x.prompt) // page if isinstance(x, Request) else 0
            if copies and full:
                if blocks.num_free - full >= min(x.params.n, max_batch):
                    copy[x.request_id] = [blocks.allocate() for _ in range(full)]
                    left[x.request_id] = x.params.n
                else:
                    skipped += 1
        fresh, again = [], []
        for x, own in zip(batch, pages):
            if isinstance(x, Sequence):
                x.pages, x.cached = own, len(x.request.prompt) + len(x.tokens) - 1
                again.append(x)
                continue
            for k in range(x.params.n):
                seq = Sequence(x, k, None, cached=len(x.prompt))
                seq.pages = [blocks.share(q) if k else q for q in own]
                seq.tokens.append(0)
                fresh.append(seq)
        peak = max(peak, blocks.used)
        for s in fresh:
            if len(s.tokens) >= s.request.params.max_new_tokens:
                finish(s)
        sched.admit_prefilled(again + [s for s in fresh if len(s.tokens) < s.request.params.max_new_tokens])
    assert blocks.used == 0
    return peak, skipped, sched.preemptions


@pytest.mark.parametrize("requests,max_batch", [
    ([(32768, 8, 1024)], 8),  # one GRPO group: the 32K prompt x 8 samples
    ([(40, 3, 8)], 8),
    ([(70, 2, 50), (45, 2, 50), (100, 2, 50)], 6),
    ([(300, 4, 30), (20, 1, 200), (150, 3, 5)], 4),  # more samples than slots
    ([(33, 16, 20)], 4),
    ([(64, 2, 1), (16, 3, 40)], 2),
])
@pytest.mark.parametrize("copies", [False, True], ids=["plain", "cascade"])
def test_pool_pages_hold_the_workload_with_the_shared_prompt_once(requests, max_batch, copies):
    """`Workload.pages` is at least the most pages the scheduler ever holds (for one group that runs
    whole, exactly that: the prompt's full pages once, not once per sample), and a pool of that size
    preempts nobody and (cascade) has room for every prompt copy."""
    work = Workload.of(requests, max_batch, 16, prefix_copies=copies)
    peak, _, _ = _drive(requests, max_batch, copies=copies)
    assert work.pages() >= peak
    if len(requests) == 1 and requests[0][1] <= max_batch and not copies:
        assert work.pages() == peak
    if requests[0] == (32768, 8, 1024) and not copies:
        assert work.pages() == 2048 + 8 * 64  # not 8 x 2112: the prompt's pages are shared
        assert work.one_sample() == 2112
    assert _drive(requests, max_batch, pool=work.pages(), copies=copies)[1:] == (0, 0)


def test_pool_pages_from_device_memory():
    """(total x utilization - in use - activations) / page bytes, capped by the workload; too little
    memory for one sample is one sentence."""
    cfg = resolve_config("qwen3-4b")
    page_bytes = PagedKVCache.bytes_per_page(cfg, 16, torch.bfloat16)
    assert page_bytes == 36 * 8 * 128 * (2 * 16 * 2 + 4)
    work = Workload.of([(32768, 8, 1024)], 8, 16)
    total, free, act = 80 * GiB, 70 * GiB, 3 * GiB  # 10 GiB in use
    assert pool_pages(free, total, act, page_bytes, work, 0.9) == 2560  # the workload caps it
    room = int(0.23 * total) - 10 * GiB - act
    assert pool_pages(free, total, act, page_bytes, work, 0.23) == room // page_bytes == 2313  # memory does
    with pytest.raises(PoolTooSmall) as err:
        pool_pages(free, total, act, page_bytes, work, 0.2)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "one sample of 33792 tokens needs 4.93 GiB of KV cache but only 3.00 GiB remain of "
        "--gpu-memory-utilization 0.2 x 80.0 GiB")


def test_plan_forwards_caps_the_tokens_of_a_forward():
    assert plan_forwards([10, 20, 30], 100) == [[(0, 0, 10), (1, 0, 20), (2, 0, 30)]]
    assert plan_forwards([10, 40, 30], 100) == [[(0, 0, 10), (1, 0, 40)], [(2, 0, 30)]]  # padded to 40
    assert plan_forwards([250, 5], 100) == [[(0, 0, 100)], [(0, 100, 200)], [(0, 200, 250)], [(1, 0, 5)]]
    for lengths in ([7, 300, 3, 64, 64, 65], [1] * 9):
        forwards = plan_forwards(lengths, 64)
        covered = sorted((i, s, e) for f in forwards for i, s, e in f)
        assert all(len(f) * max(e - s for _, s, e in f) <= 64 for f in forwards)
        for i, n in enumerate(lengths):
            mine = [(s, e) for j, s, e in covered if j == i]
            assert mine[0][0] == 0 and mine[-1][1] == n and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))


# ---------------------------------------------------------------------------- memory goes with the engine


def _pool_refs(engine):
    runner = engine.runner
    tensors = [runner.cache.k, runner.cache.v, runner.cache.centroids]
    if runner.static is not None:
        tensors += [runner.static.logp, runner.static.block_table]
    return [weakref.ref(t) for t in tensors]


@pytest.mark.parametrize("kw", [{}, {"decode_step": DecodeStep.EAGER}, {"cascade": False, "num_pages": 40},
                                {"kernels": Backend.TORCH}], ids=["cpu", "static", "no-cascade", "torch"])
def test_a_dropped_or_closed_engine_frees_its_pool(tiny, kw):
    """With the garbage collector off, reference counting alone frees the pool (and the static step's
    buffers) when the engine is dropped, or at once when it is closed or its `with` block ends."""
    prompts, params = _prompts((40, 70)), SamplingParams(max_new_tokens=12, n=3, seed=1, ignore_eos=True)
    gc.collect()
    gc.disable()
    try:
        engine = Engine(tiny, as_policy(64), EngineConfig(max_batch=4, **kw))
        engine.generate(prompts, params)
        refs = _pool_refs(engine)
        assert all(r() is not None for r in refs)
        del engine
        assert all(r() is None for r in refs)

        with Engine(tiny, as_policy(64), EngineConfig(max_batch=4, **kw)) as engine:
            first = engine.generate(prompts, params)
            refs = _pool_refs(engine)
        assert all(r() is None for r in refs)
        again = engine.generate(prompts, params)  # a closed engine runs again with a new pool
        _same(first, again)
        refs = _pool_refs(engine)
        engine.close()
        assert all(r() is None for r in refs) and engine.runner.cache is None
    finally:
        gc.enable()


# ---------------------------------------------------------------------------- chunked prefill


def _chunked_vs_one_shot(model, prompts, params, sparsity, caps, **kw):
    want = Engine(model, as_policy(sparsity), EngineConfig(max_batch=4, dense_layers=(0,),
                                                           **kw)).generate(prompts, params)
    for cap in caps:
        engine = Engine(model, as_policy(sparsity), EngineConfig(max_batch=4, dense_layers=(0,),
                                                                 max_prefill_tokens=cap, **kw))
        got = engine.generate(prompts, params)
        _same(want, got, tol=1e-4)
        assert engine.blocks.used == 0
    return want


@pytest.mark.parametrize("sparsity", [None, 64, Schedule((0, 200), (48, 96))],
                         ids=["dense", "budget", "schedule"])
def test_chunked_prefill_equals_one_shot_on_a_tiny_model(tiny, sparsity):
    """Prompts of 300, 97 and 45 tokens prefilled in forwards of at most 64, 100 or 37 tokens (chunk
    boundaries inside pages; later chunks attend to the pages earlier ones wrote): the tokens of a one-shot
    prefill, logprobs within 1e-4, and equal to teacher-forced scoring within 1e-4."""
    prompts = _prompts((300, 97, 45))
    params = SamplingParams(max_new_tokens=30, n=2, seed=4, temperature=1.0, ignore_eos=True)
    got = _chunked_vs_one_shot(tiny, prompts, params, sparsity, (64, 100, 37))
    budget_at = budget_fn(sparsity)
    for prompt, samples in zip(prompts, got):
        scored = score_sequences(tiny, [prompt] * 2, [c.token_ids for c in samples],
                                 [budget_at] if budget_at else [], dense_layers=(0,))
        ref = scored.sparse[budget_at][1] if budget_at else scored.logp_dense
        assert np.abs(np.concatenate([c.logprobs for c in samples]) - ref).max() <= 1e-4


def test_chunked_prefill_equals_one_shot_on_smollm2(smollm2):
    """SmolLM2 (fp32, the CPU's C++ kernels and cascade attention, whose prompt copy is filled from
    the pool across chunks): a 330-token prompt in chunks of 128, dense and at budget 96."""
    prompts = [torch.randint(0, 1000, (330,), generator=torch.Generator().manual_seed(3)).tolist()]
    params = SamplingParams(max_new_tokens=10, n=3, seed=2, ignore_eos=True)
    for sparsity in (None, 96):
        _chunked_vs_one_shot(smollm2.model, prompts, params, sparsity, (128,))


@pytest.mark.parametrize("sparsity", [None, 64], ids=["dense", "budget64"])
def test_a_preempted_sample_is_recomputed_in_chunks(tiny, sparsity):
    """A pool too small for every sample preempts; with a 48-token cap the recomputes (prompt and
    generated tokens, past 100 tokens) run in several chunks: tokens as a large pool's, logprobs within
    1e-4."""
    prompts = _prompts((70, 45, 100))
    params = SamplingParams(max_new_tokens=50, n=2, seed=5, temperature=1.0, ignore_eos=True)
    want = Engine(tiny, as_policy(sparsity), EngineConfig(max_batch=6, dense_layers=(0,))).generate(prompts,
                                                                                                    params)
    engine = Engine(tiny, as_policy(sparsity), EngineConfig(max_batch=6, dense_layers=(0,), num_pages=11,
                                                            max_prefill_tokens=48))
    recomputed, prefill = [], engine.runner.prefill
    engine.runner.prefill = lambda rows: recomputed.extend(
        len(r.tokens) for r in rows if r.budgets is not None) or prefill(rows)
    got = engine.generate(prompts, params)
    assert engine.stats.preemptions >= 2 and max(recomputed) > 2 * 48  # three chunks or more
    _same(want, got, tol=1e-4)


def test_profiling_forwards_run_on_a_scratch_pool(tiny):
    """The forwards a GPU runner measures before it sizes its pool (the last chunk of the longest sample
    against its whole prefix, and a decode step of max_batch rows at that length) run on a scratch pool
    of a few pages, whose pages the block tables reuse."""
    runner = ModelRunner(tiny, EngineConfig(max_batch=5, page_size=16, dense_layers=(0,),
                                            max_prefill_tokens=64,
                                            kernels=Backend.TORCH, decode_step=DecodeStep.PLAIN))
    scratch = PagedKVCache(tiny.cfg, 5, 16, torch.float32, "cpu")
    with torch.inference_mode():
        runner.profile_forwards(1000, scratch)  # 64 queries after 936 keys
        runner.profile_forwards(40, scratch)  # one chunk from position 0
    assert scratch.k.abs().sum() > 0


# ---------------------------------------------------------------------------- one engine for many runs


def test_a_reused_engine_samples_what_fresh_engines_sample(tiny):
    """Runs of different sizes through one engine (its pool grows, then is kept; request ids restart
    from 0 each run): each run equals a fresh engine's, bit for bit, and `stats` count that run only."""
    engine = Engine(tiny, as_policy(64), EngineConfig(max_batch=4))
    for lengths, n, new in (((20,), 1, 8), ((150, 60), 3, 40), ((30, 30, 30), 2, 10)):
        prompts = _prompts(lengths, seed=len(lengths))
        params = SamplingParams(max_new_tokens=new, n=n, seed=7, ignore_eos=True)
        fresh = Engine(tiny, as_policy(64), EngineConfig(max_batch=4))
        _same(fresh.generate(prompts, params), engine.generate(prompts, params))
        assert engine.stats.generated_tokens == fresh.stats.generated_tokens == len(lengths) * n * new
        assert engine.num_pages >= fresh.num_pages


def test_the_engine_follows_weight_updates(tiny):
    """After an optimizer step on an injected LoRA (in place, version counters move) and after a change
    through `.data` (no counter moves; `update_weights` says so), the reused engine samples exactly
    what an engine built on the updated weights samples."""
    import copy

    from sparrow.stages.model.adapter import add_lora

    model = copy.deepcopy(tiny)
    add_lora(model, 4, 8.0)
    model.eval()
    prompts = _prompts((40, 90))
    params = SamplingParams(max_new_tokens=16, n=2, seed=3, ignore_eos=True)
    engine = Engine(model, as_policy(64), EngineConfig(max_batch=4))
    before = engine.generate(prompts, params)
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(lora, lr=0.05)
    model(torch.tensor(prompts[:1])).logsumexp(-1).mean().backward()
    opt.step()
    after = engine.generate(prompts, params)
    _same(Engine(model, as_policy(64), EngineConfig(max_batch=4)).generate(prompts, params), after)
    assert [c.token_ids for r in after for c in r] != [c.token_ids for r in before for c in r]

    plain = copy.deepcopy(tiny)  # no LoRA: every projection packed for the C++ product
    engine = Engine(plain, as_policy(64), EngineConfig(max_batch=4))
    engine.generate(prompts, params)
    with torch.no_grad():
        for p in plain.parameters():
            p.data.mul_(1.05)
    engine.update_weights()
    _same(Engine(plain, as_policy(64), EngineConfig(max_batch=4)).generate(prompts, params),
          engine.generate(prompts, params))


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("args,message", [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a fraction in (0, 1], got 1.5"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a fraction in (0, 1], got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1, got 0"),
])
def test_rollout_refuses_bad_engine_options(prompts_file, tmp_path, args, message):
    out = tmp_path / "r.parquet"
    r = CliRunner().invoke(app, ["rollout", "--prompts", str(prompts_file), "-o", str(out), *args])
    assert r.exit_code == 2 and message in error_line(r)
    assert not out.exists()


@pytest.mark.parametrize("command", [
    ["profile", "--prompts", "PROMPTS", "-o", "OUT"],
    ["fit-cost", "-o", "OUT"],
    ["train", "--prompts", "PROMPTS", "-o", "OUT"],
    ["distill", "--prompts", "PROMPTS", "--budget", "64", "-o", "OUT"],
])
def test_engine_commands_refuse_an_out_of_range_memory_fraction(prompts_file, tmp_path, command):
    out = tmp_path / "out"
    args = [str(prompts_file) if a == "PROMPTS" else str(out) if a == "OUT" else a for a in command]
    r = CliRunner().invoke(app, [*args, "--gpu-memory-utilization", "-0.5"])
    assert r.exit_code == 2
    assert "--gpu-memory-utilization must be a fraction in (0, 1], got -0.5" in error_line(r)
    assert not out.exists()


def test_a_prompts_first_tokens_are_sampled_a_batch_at_a_time(tiny, monkeypatch):
    """A prompt's many samples (vLLM's n, GRPO's group) wait beyond the batch in `ready`; their first
    tokens come from the one prefill, sampled at most --max-num-seqs rows at a time (all at once held the
    logits of every sample, twice, and 100,000 samples ran out of memory), the same tokens as one batch."""
    params = SamplingParams(n=10, max_new_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    prompts = _prompts([21, 9])
    with Engine(tiny, Dense(), EngineConfig(max_batch=16)) as engine:
        whole = engine.generate(prompts, params)
    rows = []
    sample = Engine._sample
    monkeypatch.setattr(Engine, "_sample", lambda self, seqs, logits, *a: rows.append(len(logits))
                        or sample(self, seqs, logits, *a))
    with Engine(tiny, Dense(), EngineConfig(max_batch=4)) as engine:
        parts = engine.generate(prompts, params)
    assert rows and max(rows) <= 4
    _same(parts, whole, tol=1e-5)  # the same tokens; a decode batch of 4 rounds otherwise than one of 16
