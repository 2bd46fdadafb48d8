"""Rollout engine throughput on our users' workload: dense vs block top-k (a fixed budget, a schedule),
against the memory floor of each decode step; vLLM and Hugging Face `generate` as peers where they run.

Two modes. Speed is reported, never asserted (the issue's targets are in docs/benchmarks.md).

Whole rollout (the default): --prompts P distinct prompts x --samples K samples each, --prompt-len L
tokens, --new-tokens N new tokens, EOS ignored so every run does the same work; per sampler (dense,
--budget, --schedule) one `Engine.generate` in this process: whole-rollout seconds (prefill + decode)
and tokens/s, the mean and median decode step, and the speedup over dense (whole rollout and decode).
On a GPU the model is Qwen3-4B shapes with random bf16 weights and random prompt tokens; on a CPU
SmolLM2-135M with kv_lookup prompts (fp32). Each run's engine has its pool sized (`Engine.reserve`) and
its decode graphs captured for the run's batch and budgets (`Engine.warm_up`) before its clock starts,
and every Triton kernel variant is compiled by a short untimed run first: what is timed is what a
warmed engine (the trainer's, reused step after step) spends.

Own KV (`--own-kv NxL[,NxL...]`): the middle of a rollout, N sequences that each own L tokens of KV
(N distinct random prompts of L tokens, n = 1), decode steps only: after --warmup steps, the mean and
median of --steps steps per sampler (the schedule's budget is the one at length L).

Per decode step the floor is the step's bytes read once at the device's copy bandwidth (a large tensor
copy, read + write): the weights, the K and V every sequence attends to (a prompt's pages shared by its
samples counted once) and the page centroids the sparse layers score. "x floor" is the measured step
over it, "dense floor" the dense step's floor and "floor x" the speedup the floors predict (dense floor /
the sampler's floor), beside the measured one.

`--cost cost.parquet` (a `sparrow fit-cost` artifact for this model and device): each sampler's decode
seconds predicted by the fitted cost model (`CostModel.rollout_seconds`, batch P x K from length L to
L + N), printed beside the measured ones, with the whole-rollout speedup it predicts (the predicted decode
plus each run's measured prefill, which is dense in every sampler) and the relative error.

`--repeats N` (whole rollout; default 1, one run per sampler and no interval): with N >= 2 the dense run
and each sampler's run are repeated N times, interleaved (dense, budget, schedule, dense, ...) so a drift
of the machine hits all alike, each with the same seed and prompts. "x dense" and "dec x" are then the
means of the per-repeat ratios (dense seconds / the sampler's, whole rollout and decode), "±" and "dec ±"
the half-widths of their 95% t-intervals, and a line per sampler after the table says both; seconds, tok/s
and steps are the means over the repeats (HF runs once, over dense's mean). The per-repeat seconds are
kept in the table (repeat_total_s, repeat_decode_s). To get an interval, pass --repeats 3 or more (2 gives
a wide one).

vLLM (when installed: `make vllm`) starts once per `--vllm-dtype`, before the first repeat, and runs in
every repeat after our samplers, so each of our runs has a vLLM run beside it: a line per sampler and
peer after the table gives our speed over vLLM's (its seconds over ours, whole rollout and decode, the
mean of the per-repeat ratios with a 95% t-interval; in the table `x_vllm-<dtype>`,
`x_vllm-<dtype>_decode` and their `_half_width`).

vLLM and transformers' `generate` run on the same prompts, samples, new tokens and temperature, dense
(not with random weights): vLLM in `--vllm-dtype` with prefix caching (reset before each timed run),
in-process, its start-up timed apart, one untimed warm-up; HF with every prompt repeated once per
sample (it prefills every copy; the engine prefills once and shares the pages). On the CPU our engine tunes
glibc's allocator for the process (stages/engine/cpu/allocator.py), so every run here runs with it. Writes
rollout.parquet (or rollout-own-kv.parquet) into --results (default bench/results).

    .venv/bin/python bench/rollout.py --threads 1                       # the CPU run (about 25 minutes)
    .venv/bin/python bench/rollout.py --prompts 2 --samples 2 --prompt-len 300 --new-tokens 48 \\
        --no-hf --no-vllm --threads 1                                 # a CPU smoke run
    .venv/bin/python bench/rollout.py --own-kv 4x1024,8x512 --steps 8 --threads 1    # own KV, CPU smoke
    python bench/rollout.py --prompts 4 --samples 8 --prompt-len 256 --new-tokens 8192 --temperature 1 \\
        --cost cost.parquet                                           # GPU: Qwen3-4B shapes, random weights
    python bench/rollout.py --own-kv 8x32768,16x16384,32x8192,16x4096 --temperature 1   # GPU, own KV
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import torch
from common import bench_parser, copy_bandwidth, device_name, sync, t_half_width, write_results

from sparrow.kernels import cpu_attention
from sparrow.stages.core.definitions import validate_budget
from sparrow.stages.core.published_schedules import published_budgets
from sparrow.stages.core.schedule import Schedule
from sparrow.stages.core.sparsity import as_policy, budget_fn
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model.loading import embedded_checkpoint, load_model
from sparrow.stages.tasks import make_prompts

PUBLISHED_BIN = 2000  # tokens per bin of the published schedules
DENSE_LAYERS = (0, 1)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name == "embed_tokens.weight" and not model.cfg.tie_word_embeddings:
            continue  # an untied embedding is read one row per token, not whole
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(cfg, prompt: int, new: int, samples: int, budget_at, dense_layers, elem: int,
                      page: int = 16, shared_once: bool = False, cent_elem: int = 4) -> float:
    """Mean K+V (+ centroid) bytes one decode step of one prompt's samples reads over the run: as the
    kernels request them (each sample reads the prompt pages it shares), or with `shared_once` the floor
    where shared prompt pages (and their centroids) are read once per step."""
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * elem
    total = 0.0
    for i in range(1, new):  # decode steps: cache holds prompt + i tokens
        n = prompt + i
        b = budget_at(n) if budget_at else 0
        n_pages = -(-n // page)
        sparse = b > 0 and n_pages > b // page
        kept = min(n, b) if sparse else n
        n_sparse = cfg.num_layers - len(dense_layers) if b > 0 else 0  # they score pages even when short
        unique = prompt + samples * i  # tokens in the cache, the prompt's once
        dense_tokens = unique if shared_once else samples * n
        sparse_tokens = min(samples * kept, unique) if shared_once else samples * kept
        cent_pages = -(-unique // page) if shared_once else samples * n_pages
        total += ((cfg.num_layers - n_sparse) * dense_tokens + n_sparse * sparse_tokens) * per_token
        total += n_sparse * cent_pages * cfg.num_kv_heads * cfg.head_dim * cent_elem
    return total / max(new - 1, 1)


def parse_schedule(spec: str) -> Schedule:
    """A schedule artifact, 'published:MODEL:THRESHOLD', or 'cpu-default' (for SmolLM2's 8K context: 256
    below 4K tokens, 512 to 6.5K, 768 beyond)."""
    if spec == "cpu-default":
        return Schedule((0, 4096, 6656), (256, 512, 768))
    if spec.startswith("published:"):
        _, model, threshold = spec.split(":")
        budgets = published_budgets(model, float(threshold))
        if budgets is None:
            raise SystemExit(f"--schedule {spec}: no published schedule for {model} at {threshold}")
        return Schedule(tuple(PUBLISHED_BIN * i for i in range(len(budgets))), budgets)
    return Schedule.from_artifact(spec)


def parse_own_kv(spec: str) -> list[tuple[int, int]]:
    """'8x32768,16x4096' -> [(8, 32768), (16, 4096)] (sequences x KV tokens each)."""
    try:
        out = [tuple(int(v) for v in item.lower().split("x")) for item in spec.split(",") if item.strip()]
    except ValueError:
        out = []
    if not out or any(len(x) != 2 or min(x) < 1 for x in out):
        raise SystemExit(f"--own-kv {spec!r}: expected NxL[,NxL...] (sequences x KV tokens), e.g. 8x32768")
    return out


def random_prompts(cfg, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist() for _ in range(count)]


def make_prompts_for(loaded, args) -> list[list[int]]:
    """P distinct prompts of one length: on a real checkpoint kv_lookup prompts of about --prompt-len
    tokens (at least 512), cut to the shortest; random token ids for random weights or shorter prompts."""
    if args.random_weights or loaded.tokenizer is None or args.prompt_len < 512:
        return random_prompts(loaded.config, args.prompts, args.prompt_len)
    rows = make_prompts("kv_lookup", args.prompts, 0, loaded.tokenizer, context_tokens=args.prompt_len)
    prompts = [list(r["prompt_token_ids"]) for r in rows]
    return [p[: min(map(len, prompts))] for p in prompts]


def sparsity_of(sampler: str):
    """'dense' | 'budget:B' | 'schedule:SPEC' (a row's `sampler`) -> what the engine takes."""
    kind, _, value = sampler.partition(":")
    return None if kind == "dense" else int(value) if kind == "budget" else parse_schedule(value)


def vectorized(sparsity):
    """A budget function of arrays of cache lengths (None = dense) for the cost model."""
    fn = budget_fn(sparsity)
    return None if fn is None else np.vectorize(lambda c: int(fn(int(c))))


# ---------------------------------------------------------------------------------------- our engine

def warm_up(model, args, samplers, cfg) -> None:
    """Compile the Triton kernels the timed runs use on a short run past the largest budget (a GPU's first
    launch of each variant costs about a second); on the CPU, load (or build) the C++ kernels."""
    if model.embed_tokens.weight.device.type != "cuda":
        cpu_attention.available()
        return
    short = random_prompts(cfg, 1, max(4 * max(args.budget, 512), 4096), seed=1)
    params = SamplingParams(max_new_tokens=4, n=min(args.samples * args.prompts, 8),
                            temperature=args.temperature, seed=0, ignore_eos=True)
    for _, sampler in samplers:
        with Engine(model, as_policy(sparsity_of(sampler)), EngineConfig(max_batch=params.n)) as engine:
            engine.generate(short, params)


def run_engine(model, prompts, args, sampler, label, max_new: int, samples: int, warmup_budgets):
    """One generate() of these prompts on a fresh engine whose pool and graphs are ready first."""
    sparsity = sparsity_of(sampler)
    params = SamplingParams(max_new_tokens=max_new, n=samples, temperature=args.temperature, seed=0,
                            ignore_eos=True)
    batch = len(prompts) * samples
    config = EngineConfig(max_batch=batch, cascade=False if args.no_cascade else None)
    with Engine(model, as_policy(sparsity), config) as engine:
        engine.reserve(prompts, params)
        engine.warm_up(batch, warmup_budgets(engine.budget_at))
        sync(model.embed_tokens.weight.device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        total = time.perf_counter() - t0
        cent_elem = engine.runner.cache.centroids.element_size()
    assert all(len(c.token_ids) == max_new for r in out for c in r)
    s = engine.stats
    return {"engine": label, "sampler": sampler, "total_s": total, "prefill_s": s.prefill_s,
            "decode_s": s.decode_s, "decode_steps": s.decode_steps, "step_times": list(s.step_times),
            "mean_budget": s.budget_sum / max(s.decode_tokens, 1), "cent_elem": cent_elem}, engine.budget_at


def samplers_of(args) -> list[tuple[str, str]]:
    """(label, sampler spec) of the runs asked for, dense first."""
    runs = {"dense": ("dense", "dense"), "budget": (f"sparse-{args.budget}", f"budget:{args.budget}"),
            "schedule": ("sparse-schedule", f"schedule:{args.schedule}")}
    names = [n.strip() for n in args.samplers.split(",") if n.strip()]
    if args.no_schedule:
        names = [n for n in names if n != "schedule"]
    bad = [n for n in names if n not in runs]
    if bad or not names:
        raise SystemExit(f"--samplers {args.samplers!r}: expected a comma-separated subset of "
                         "dense,budget,schedule")
    if names[0] != "dense":
        raise SystemExit("--samplers: dense must come first (every speedup is over it)")
    return [runs[n] for n in names]


# ---------------------------------------------------------------------------------------- peers

def run_hf(args, prompts, device, dtype):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(embedded_checkpoint(), dtype=dtype).to(device)
    hf.eval()
    x = torch.tensor([p for p in prompts for _ in range(args.samples)], device=device)
    stamps = []

    class Stamp(transformers.LogitsProcessor):  # called once per forward: marks the steps
        def __call__(self, ids, scores):
            sync(device)
            stamps.append(time.perf_counter())
            return scores

    kw = dict(do_sample=False)
    if args.temperature > 0:
        kw = dict(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, pad_token_id=0,
                          logits_processor=[Stamp()], **kw)
    sync(device)
    total = time.perf_counter() - t0
    assert out.shape[1] - x.shape[1] == args.new_tokens
    steps = np.diff(stamps)
    del hf
    return {"engine": "hf-generate", "total_s": total, "prefill_s": stamps[0] - t0,
            "decode_s": float(steps.sum()), "decode_steps": len(steps), "step_times": steps.tolist(),
            "mean_budget": 0.0}


class VllmPeer:
    """vLLM dense on the same workload: started once (its start-up timed apart) with an untimed warm-up,
    then `run` is one timed generate, called in every repeat beside our engine's runs."""

    def __init__(self, args, prompts, cfg, dtype: str):
        from sparrow.stages.backends.vllm_sampler import VllmSampler, vllm_checkpoint

        self.args, self.prompts, self.dtype = args, prompts, dtype
        self.sampler = VllmSampler(vllm_checkpoint(args.model), dtype=dtype, seed=0,
                                   max_batch=args.samples * len(prompts),
                                   max_model_len=max(len(p) for p in prompts) + args.new_tokens,
                                   eos_ids=cfg.eos_token_ids)
        self.startup_s = self.sampler.timing.startup_s
        other = random_prompts(cfg, 1, 256, seed=1)  # another prompt: the warm-up leaves no prefix to reuse
        self.sampler.generate(other, SamplingParams(max_new_tokens=8, n=args.samples,
                                                    temperature=args.temperature, ignore_eos=True))

    def run(self) -> dict:
        args = self.args
        params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, temperature=args.temperature,
                                seed=0, ignore_eos=True)
        self.sampler.llm.reset_prefix_cache()  # every repeat prefills the prompt, as ours does
        out = self.sampler.generate(self.prompts, params)
        t = self.sampler.timing
        assert all(len(c.token_ids) == args.new_tokens for r in out for c in r)
        step_ms = 1e3 * t.decode_s / max(args.new_tokens - 1, 1)
        return {"engine": f"vllm-{self.dtype}", "total_s": t.seconds, "setup_s": self.startup_s,
                "prefill_s": t.prefill_s, "decode_s": t.decode_s, "decode_steps": args.new_tokens - 1,
                "step_times": [step_ms / 1e3], "mean_budget": 0.0}


# ---------------------------------------------------------------------------------------- the modes

def whole_rollout(loaded, args, device, dtype) -> list[dict]:
    model, cfg = loaded.model, loaded.config
    prompts = make_prompts_for(loaded, args)
    length = len(prompts[0])
    samplers = samplers_of(args)
    warm_up(model, args, samplers, cfg)

    def budgets_of(budget_at):  # every budget a step of this run uses: its graphs are captured first
        lengths = range(length + 1, length + args.new_tokens + 1)
        return {int(budget_at(c)) if budget_at else 0 for c in lengths}

    elem = torch.tensor([], dtype=dtype).element_size()
    real_weights = not args.random_weights and loaded.tokenizer is not None
    peers = []
    if real_weights and not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        peers = [VllmPeer(args, prompts, cfg, vdtype)
                 for vdtype in (args.vllm_dtype or str(dtype).removeprefix("torch.")).split(",")]
    runs: dict[str, list[dict]] = {label: [] for label, _ in samplers}
    peer_runs: dict[str, list[dict]] = {f"vllm-{peer.dtype}": [] for peer in peers}
    budget_ats = {}
    for repeat in range(args.repeats):  # interleaved: a drift of the machine hits every sampler alike
        tag = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
        for label, sampler in samplers:
            row, budget_ats[label] = run_engine(model, prompts, args, sampler, label, args.new_tokens,
                                                args.samples, budgets_of)
            runs[label].append(row)
            times = row["step_times"]
            print(f"  {label}{tag}: {row['total_s']:.1f} s (prefill {row['prefill_s']:.1f} s, decode "
                  f"{row['decode_s']:.1f} s, step mean {1e3 * np.mean(times):.2f} ms, median "
                  f"{1e3 * np.median(times):.2f} ms)", flush=True)
        for peer in peers:
            row = peer.run()
            peer_runs[row["engine"]].append(row)
            print(f"  {row['engine']}{tag}: {row['total_s']:.1f} s (prefill {row['prefill_s']:.1f} s, decode "
                  f"{row['decode_s']:.1f} s; + {row['setup_s']:.0f} s start-up, once)", flush=True)
    rows = []
    for label, _ in samplers:
        row = merge_repeats(runs[label])
        for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
            row[key] = args.prompts * kv_bytes_per_step(cfg, length, args.new_tokens, args.samples,
                                                        budget_ats[label], DENSE_LAYERS, elem,
                                                        shared_once=once, cent_elem=row["cent_elem"])
        row["prompt_tokens"] = length
        rows.append(row)
    for peer in peers:
        row = merge_repeats(peer_runs[f"vllm-{peer.dtype}"])
        velem = torch.tensor([], dtype=getattr(torch, peer.dtype)).element_size()
        row["weight_bytes"] = weight_bytes(model) * velem // elem
        for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
            row[key] = args.prompts * kv_bytes_per_step(cfg, length, args.new_tokens, args.samples, None,
                                                        DENSE_LAYERS, velem, shared_once=once)
        rows.append(row)
    over_peers(rows)
    if real_weights and not args.no_hf:
        row = run_hf(args, prompts, device, dtype)
        elem = torch.tensor([], dtype=dtype).element_size()
        for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
            row[key] = args.prompts * kv_bytes_per_step(cfg, length, args.new_tokens, args.samples, None,
                                                        DENSE_LAYERS, elem, shared_once=once)
        rows.append(row)
        print(f"  hf-generate: {row['total_s']:.1f} s", flush=True)
    return rows


def merge_repeats(runs: list[dict]) -> dict:
    """One row of a sampler's repeated runs: the mean seconds, every repeat's decode steps, and each
    repeat's whole-rollout and decode seconds (what its speedups over dense are taken from)."""
    row = dict(runs[0])
    for key in ("total_s", "prefill_s", "decode_s", "mean_budget"):
        row[key] = float(np.mean([r[key] for r in runs]))
    row["step_times"] = [t for r in runs for t in r["step_times"]]
    row.update(repeats=len(runs), repeat_total_s=[r["total_s"] for r in runs],
               repeat_decode_s=[r["decode_s"] for r in runs])
    return row


def over_peers(rows: list[dict]) -> None:
    """Each of our runs' speed over each vLLM peer's, as `x_<peer>` (whole rollout) and `x_<peer>_decode`:
    the mean of the per-repeat ratios (the peer's seconds in repeat i over ours in repeat i, the two run
    back to back) with the half-widths of their 95% t-intervals."""
    ours = [r for r in rows if r.get("sampler")]
    for peer in (r for r in rows if r["engine"].startswith("vllm-")):
        for r in ours:
            for key, seconds in (("", "repeat_total_s"), ("_decode", "repeat_decode_s")):
                mean, half = ratio_interval(peer[seconds], r[seconds])
                r[f"x_{peer['engine']}{key}"], r[f"x_{peer['engine']}{key}_half_width"] = mean, half


def interval_words(row: dict, key: str) -> str:
    """'1.80x ± 0.05', or '1.80x' where one run gives no interval."""
    half = row.get(f"{key}_half_width")
    return f"{row[key]:.2f}x" + ("" if half is None else f" ± {half:.2f}")


def interval_kind(row: dict) -> str:
    return (f"mean of {row['repeats']} repeats, 95% t-interval" if row.get("repeats", 1) > 1
            else "one run, no interval")


def ratio_interval(dense_s, sampler_s) -> tuple[float, float | None]:
    """The mean of the per-repeat speedups dense_s[i] / sampler_s[i] and the half-width of their 95%
    t-interval (None for one repeat: no interval)."""
    with np.errstate(divide="ignore", invalid="ignore"):  # no decode (one new token): nan, as the table says
        ratios = np.asarray(dense_s, dtype=np.float64) / np.asarray(sampler_s, dtype=np.float64)
    return float(ratios.mean()), (t_half_width(ratios) if len(ratios) > 1 else None)


def own_kv(loaded, args, dtype) -> list[dict]:
    """Decode steps of N sequences that each own L tokens of KV, per sampler."""
    model, cfg = loaded.model, loaded.config
    samplers = samplers_of(args)
    args.samples = 1
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    steps = args.warmup + args.steps + 1  # new tokens: the first comes from the prefill
    for n_seq, length in parse_own_kv(args.own_kv):
        prompts = random_prompts(cfg, n_seq, length, seed=n_seq)
        args.prompts = n_seq
        warm_up(model, args, samplers, cfg)

        def budgets_of(fn, lo=length):
            return {int(fn(c)) if fn else 0 for c in range(lo + 1, lo + steps + 1)}

        for label, sampler in samplers:
            at = budget_fn(sparsity_of(sampler))
            row, budget_at = run_engine(model, prompts, args, sampler, label, steps, 1, budgets_of)
            row["step_times"] = row["step_times"][args.warmup:]
            for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
                row[key] = n_seq * kv_bytes_per_step(cfg, length, steps, 1, budget_at, DENSE_LAYERS, elem,
                                                     shared_once=once, cent_elem=row["cent_elem"])
            row.update(sequences=n_seq, kv_tokens=length, budget_at_length=int(at(length + 1)) if at else 0)
            rows.append(row)
            print(f"  {n_seq}x{length} {label}: {1e3 * np.mean(row['step_times']):.2f} ms/step", flush=True)
    return rows


def add_floors(rows: list[dict], w_bytes: int, bw: float, group: str | None = None) -> None:
    """Floors, speedups over dense (within each own-KV configuration), fraction of bandwidth."""
    dense = {}
    for r in rows:
        r.setdefault("weight_bytes", w_bytes)
        times = r.pop("step_times")
        r["step_ms"] = 1e3 * float(np.mean(times)) if len(times) else float("nan")
        r["median_step_ms"] = 1e3 * float(np.median(times)) if len(times) else float("nan")
        r["bytes_per_step"] = r["weight_bytes"] + r["kv_bytes_per_step"]
        r["bw_fraction_requested"] = r["bytes_per_step"] / (r["step_ms"] / 1e3) / bw
        r["floor_ms"] = 1e3 * (r["weight_bytes"] + r["kv_unique_bytes_per_step"]) / bw
        r["x_floor"] = r["step_ms"] / r["floor_ms"]
        key = r.get(group) if group else None
        if r["engine"] == "dense":
            dense[key] = r
        d = dense.get(key)
        r["dense_floor_ms"] = d["floor_ms"] if d else float("nan")
        r["floor_speedup"] = r["dense_floor_ms"] / r["floor_ms"]
        r["step_speedup"] = d["step_ms"] / r["step_ms"] if d else float("nan")
        if "repeat_total_s" in r and d:  # our engine's runs: repeat i over dense's repeat i
            r["speedup"], r["speedup_half_width"] = ratio_interval(d["repeat_total_s"], r["repeat_total_s"])
            r["decode_speedup"], r["decode_speedup_half_width"] = ratio_interval(d["repeat_decode_s"],
                                                                                 r["repeat_decode_s"])
        elif "total_s" in r and d:  # a peer, run once: over dense's mean
            r["speedup"], r["speedup_half_width"] = ratio_interval([d["total_s"]], [r["total_s"]])
            r["decode_speedup"], r["decode_speedup_half_width"] = ratio_interval([d["decode_s"]],
                                                                                 [r["decode_s"]])
            r["repeats"] = 1


def predict(rows: list[dict], cost, label: str) -> None:
    """Each engine run's decode seconds from the fitted cost model (batch prompts x samples, from its prompt
    length for its new tokens), and the decode and whole-rollout speedups they predict, printed beside the
    measured ones."""
    ours = [r for r in rows if r.get("sampler")]
    first = ours[0]
    batch, length, new = first["prompts"] * first["samples"], first["prompt_tokens"], first["new_tokens"]
    for r in ours:
        budget_at = vectorized(sparsity_of(r["sampler"]))
        r["predicted_decode_s"] = cost.rollout_seconds(budget_at, new, batch, length)
    dense = ours[0]
    for r in ours:
        r["predicted_decode_speedup"] = dense["predicted_decode_s"] / r["predicted_decode_s"]
        r["predicted_speedup"] = ((dense["prefill_s"] + dense["predicted_decode_s"])
                                  / (r["prefill_s"] + r["predicted_decode_s"]))
    for r in ours:
        r["prediction_error"] = r["predicted_speedup"] / r["speedup"] - 1
    print(f"fitted cost model ({cost.source}, {label}): batch {batch}, prompt {length}, {new} new tokens; "
          "whole = predicted decode + the run's measured prefill")
    print_table(ours, [("engine", "engine", 16, ""), ("decode s", "decode_s", 9, ".1f"),
                       ("predicted", "predicted_decode_s", 9, ".1f"), ("dec x", "decode_speedup", 7, ".2f"),
                       ("predicted", "predicted_decode_speedup", 9, ".2f"), ("whole x", "speedup", 7, ".2f"),
                       ("predicted", "predicted_speedup", 9, ".2f"), ("error", "prediction_error", 7, ".1%")])


STEP_COLUMNS = [("step ms", "step_ms", 8, ".2f"), ("median", "median_step_ms", 7, ".2f"),
                ("floor ms", "floor_ms", 8, ".2f"), ("x floor", "x_floor", 7, ".2f"),
                ("dense floor", "dense_floor_ms", 11, ".2f")]


def print_table(rows: list[dict], columns: list[tuple[str, str, int, str]]) -> None:
    """Columns (header, key, width, format spec); a missing value (or None) prints as nan."""
    print(" ".join(f"{h:>{w}}" for h, _, w, _ in columns))
    for r in rows:
        values = [float("nan") if r.get(k) is None else r[k] for _, k, _, _ in columns]
        print(" ".join(format(v, f">{w}{f}") for v, (_, _, w, f) in zip(values, columns)))


def main() -> None:
    ap = bench_parser(__doc__, "rollout", "rollout-own-kv")
    ap.add_argument("--model", default=None, help="default: qwen3-4b (random weights) on a GPU, "
                    "smollm2-135m on a CPU")
    ap.add_argument("--prompts", type=int, default=1, help="distinct prompts (P)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (K)")
    ap.add_argument("--prompt-len", "--context", dest="prompt_len", type=int, default=None,
                    help="prompt tokens (L; default 256 on a GPU, 6000 on a CPU)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sample (N; default 8192 on "
                    "a GPU, 1024 on a CPU)")
    ap.add_argument("--own-kv", default=None, help="NxL[,NxL...]: the own-KV mode instead of a whole rollout")
    ap.add_argument("--steps", type=int, default=32, help="own KV: timed decode steps per sampler")
    ap.add_argument("--warmup", type=int, default=4, help="own KV: untimed decode steps first")
    ap.add_argument("--budget", type=int, default=None, help="the fixed budget (default 2048 on a GPU, 512 "
                    "on a CPU)")
    ap.add_argument("--schedule", default=None, help="a schedule artifact, published:MODEL:THRESHOLD or "
                    "cpu-default (default: published:qwen3-4b:0.86 on a GPU; cpu-default on a CPU: 256 below "
                    "4K tokens, 512 to 6.5K, 768 beyond)")
    ap.add_argument("--samplers", default="dense,budget,schedule", help="which runs, dense first")
    ap.add_argument("--repeats", type=int, default=1, help="whole rollout: run dense and each sampler this "
                    "many times, interleaved; 2 or more gives each speedup a 95%% t-interval")
    ap.add_argument("--cost", default=None, help="a fit-cost artifact: print its predicted speedups")
    ap.add_argument("--random-weights", action="store_true", help="random weights (default on a GPU: "
                    "Qwen3-4B shapes have no weights here; random prompt tokens, no HF or vLLM)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (all runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="our engine's (and by default vLLM's) dtype; default: bfloat16 on CUDA, "
                    "float32 on CPU")
    ap.add_argument("--no-cascade", action="store_true", help="our engine without cascade attention")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-schedule", action="store_true", help="skip the engine's schedule run")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (run when installed)")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's dtype, or several comma-separated, one "
                    "engine each (default: our engine's; bfloat16 is vLLM's own CPU default)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.repeats > 1 and args.own_kv:
        ap.error("--repeats applies to the whole rollout, not --own-kv")
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.model = args.model or ("qwen3-4b" if gpu else "smollm2-135m")
    args.random_weights = args.random_weights or (gpu and args.model == "qwen3-4b")
    args.prompt_len = args.prompt_len or (256 if gpu else 6000)
    args.new_tokens = args.new_tokens or (8192 if gpu else 1024)
    args.budget = args.budget or (2048 if gpu else 512)
    if min(args.prompts, args.samples, args.prompt_len, args.new_tokens, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--prompts, --samples, --prompt-len, --new-tokens and --steps must be at least 1")
    if args.own_kv:
        parse_own_kv(args.own_kv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if gpu else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else dtype
    args.schedule = args.schedule or ("published:qwen3-4b:0.86" if gpu else "cpu-default")
    parse_schedule(args.schedule)  # a bad one is refused before the model loads
    try:
        validate_budget(args.budget)
    except ValueError as e:
        ap.error(f"--budget: {e}")
    t0 = time.perf_counter()
    loaded = load_model(args.model, device=str(device), dtype=dtype, random_weights=args.random_weights)
    load_s = time.perf_counter() - t0
    cost = None
    if args.cost:
        from sparrow.stages.cost import load_cost

        cost = load_cost(args.cost, loaded.config)
    w_bytes = weight_bytes(loaded.model)

    if args.own_kv:
        rows = own_kv(loaded, args, dtype)
    else:
        rows = whole_rollout(loaded, args, device, dtype)
    bw = copy_bandwidth(device)  # after the runs: its fresh memory slowed a following prefill
    add_floors(rows, w_bytes, bw, group="kv_tokens" if args.own_kv else None)
    name = device_name(device)
    where = (f"{device} ({name}, {torch.get_num_threads()} threads), copy bandwidth {bw / 1e9:.1f} GB/s, "
             f"weights {w_bytes / 1e6:.0f} MB")
    for r in rows:
        r.update(device=str(device), device_name=name, threads=torch.get_num_threads(), copy_gb_s=bw / 1e9,
                 model=args.model,
                 temperature=args.temperature)
    if args.own_kv:
        print(f"{loaded.name}, own KV (decode steps only: {args.warmup} untimed, {args.steps} timed), "
              f"temperature {args.temperature}, {where}")
        for r in rows:
            r["config"] = f"{r['sequences']}x{r['kv_tokens']}"
        print_table(rows, [("seqs x KV", "config", 11, ""), ("engine", "engine", 16, ""),
                           ("budget", "budget_at_length", 6, "d"), *STEP_COLUMNS,
                           ("x dense", "step_speedup", 7, ".2f"), ("floor x", "floor_speedup", 7, ".2f")])
        write_results(rows, "rollout-own-kv", args.results)
        return
    args.prompt_len = rows[0]["prompt_tokens"]
    tokens = args.prompts * args.samples * args.new_tokens
    decode_tokens = args.prompts * args.samples * (args.new_tokens - 1)
    for r in rows:
        r["tok_s"] = tokens / r["total_s"]
        r["decode_tok_s"] = decode_tokens / r["decode_s"] if r["decode_s"] > 0 else float("nan")
        r.setdefault("setup_s", load_s)
        r["command_s"] = r["setup_s"] + r["total_s"]
        r.update(prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens,
                 prompt_tokens=args.prompt_len)
    print(f"{loaded.name}, {args.prompts} prompts x {args.samples} samples, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens (EOS ignored, temperature {args.temperature}), {where}")
    intervals = [("±", "speedup_half_width", 5, ".2f")] if args.repeats > 1 else []
    decode_intervals = ([("dec ±", "decode_speedup_half_width", 5, ".2f"), ("repeats", "repeats", 7, "d")]
                        if args.repeats > 1 else [])
    print_table(rows, [("engine", "engine", 16, ""), ("command s", "command_s", 9, ".1f"),
                       ("total s", "total_s", 8, ".1f"), ("prefill s", "prefill_s", 9, ".1f"),
                       ("decode s", "decode_s", 9, ".1f"), ("tok/s", "tok_s", 7, ".1f"),
                       ("x dense", "speedup", 7, ".2f"), *intervals, ("dec x", "decode_speedup", 6, ".2f"),
                       *decode_intervals, *STEP_COLUMNS, ("floor x", "floor_speedup", 7, ".2f")])
    if args.repeats > 1:
        for r in rows[1:]:
            if r.get("sampler") and r.get("speedup_half_width") is not None:
                print(f"  {r['engine']} over dense, mean of {r['repeats']} repeats (95% t-interval): whole "
                      f"{r['speedup']:.2f}x ± {r['speedup_half_width']:.2f}, decode "
                      f"{r['decode_speedup']:.2f}x ± {r['decode_speedup_half_width']:.2f}")
    for peer in (r["engine"] for r in rows if r["engine"].startswith("vllm-")):
        for r in (r for r in rows if r.get("sampler")):
            print(f"  {r['engine']} over {peer}: whole {interval_words(r, f'x_{peer}')}, decode "
                  f"{interval_words(r, f'x_{peer}_decode')} ({interval_kind(r)})")
    if cost is not None:
        predict(rows, cost, args.cost)
    write_results(rows, "rollout", args.results)


if __name__ == "__main__":
    main()
