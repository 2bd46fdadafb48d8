"""Rollout engine throughput: dense vs block top-k sparse engine vs vLLM vs Hugging Face `generate`.

Issue targets (reported, not asserted). CPU: SmolLM2-135M, one ~6K-token kv_lookup prompt, 8 samples x
1,024 new tokens, EOS ignored so every run does the same work: the sparse engine at budget 512 reaches
>= 2x the dense engine's decode tokens/s, and the dense engine >= HF generate on the same batch.
GPU: Qwen3-4B shapes with random bf16 weights, batch 32, the published qwen3-4b 0.86 schedule >= 2.4x
the dense engine's tokens/s, and the dense decode step within 1.3x of the bandwidth limit.
Measured in one process on the same device: the dense engine, the sparse engine at a fixed budget and
with a schedule, and transformers' greedy `generate` on the same weights (the embedded checkpoint
directory) with the prompt repeated once per sample (HF prefills every copy; the engine prefills once
and shares the pages, so end-to-end numbers favour the engine and decode-only numbers are the fair
comparison). HF runs last. On the CPU our engine tunes glibc's allocator for the process
(stages/rollout/allocator.py), so every run here, vLLM's and HF's included, runs with it.
vLLM (when installed: `make vllm`) runs after our engine, on the same prompt, samples, new tokens and
temperature, dense, in `--vllm-dtype` (default: our engine's dtype, fp32 on the CPU), with prefix
caching, in-process, with its global seed (per-request seeds fail on the CPU). Its start-up (load +
torch.compile) is timed apart, then one short untimed generate warms it up and its prefix cache is
reset; prefill s and decode s come from its request stats (first token, last token), its step time is
decode s over the decode steps (no median).
"command s" is what a `sparrow rollout` command would spend: model load (ours) or start-up (vLLM)
plus the generate call. Per decode step, "BW frac" is the fraction of the memory-bandwidth limit
reached: (weight bytes + KV bytes read, the prompt pages the samples share counted once) / step time /
the device's copy bandwidth (a large tensor copy, read + write); "floor ms" is that limit's step time
and "x floor" the measured step over it. "MB/step" and `bw_fraction_requested` count the KV bytes as
the kernels request them (each sample reads the prompt pages it shares, some perhaps from a cache).
Writes bench/results/rollout.parquet.

    .venv/bin/python bench/rollout.py                         # the CPU run (about 25 minutes)
    .venv/bin/python bench/rollout.py --context 1000 --new-tokens 64 --samples 4   # a quick one
    .venv/bin/python bench/rollout.py --new-tokens 320 --temperature 1 --no-hf --no-schedule  # vs vLLM
    .venv/bin/python bench/rollout.py --model qwen3-4b --random-weights --context 16384 --samples 32 \
        --budget 2048 --schedule published:qwen3-4b:0.86                  # GPU (no HF baseline)
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import time

import numpy as np
import torch
from common import copy_bandwidth, sync, write_results

from sparrow.kernels import cpu_attention
from sparrow.stages.model.loading import embedded_checkpoint, load_model
from sparrow.stages.published_schedules import published_budgets
from sparrow.stages.rollout import Engine, SamplingParams
from sparrow.stages.schedule import Schedule
from sparrow.stages.tasks import make_prompts

PUBLISHED_BIN = 2000  # tokens per bin of the published schedules


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
                      page: int = 16, shared_once: bool = False) -> float:
    """Mean K+V (+ centroid) bytes one decode step reads over the run: as the kernels request them (each
    sample reads the prompt pages it shares), or with `shared_once` the floor where shared prompt
    pages (and their centroids) are read once per step, as cascade attention would."""
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * elem
    total = 0.0
    for i in range(1, new):  # decode steps: cache holds prompt + i tokens
        n = prompt + i
        b = budget_at(n) if budget_at else 0
        n_pages = -(-n // page)
        sparse = b > 0 and n_pages > b // page
        kept = min(n, b) if sparse else n
        n_sparse = cfg.num_layers - len(dense_layers) if b > 0 else 0
        unique = prompt + samples * i  # tokens in the cache, the prompt's once
        dense_tokens = unique if shared_once else samples * n
        sparse_tokens = min(samples * kept, unique) if shared_once else samples * kept
        cent_pages = -(-unique // page) if shared_once else samples * n_pages
        total += ((cfg.num_layers - n_sparse) * dense_tokens + n_sparse * sparse_tokens) * per_token
        total += n_sparse * cent_pages * cfg.num_kv_heads * cfg.head_dim * 4
    return total / max(new - 1, 1)


def warm_up(model, prompt, args, runs) -> None:
    """Compile every Triton kernel variant the timed runs use (a GPU's first launch of each costs about
    a second) on a short generation past the budget, so that no timed run pays for compiling. On the
    CPU, load (or build, once per machine) the C++ attention kernels."""
    if model.embed_tokens.weight.device.type != "cuda":
        cpu_attention.available()
        return
    short = prompt[: max(4 * args.budget, 4096)]
    params = SamplingParams(max_new_tokens=4, n=args.samples, temperature=args.temperature, seed=0,
                            ignore_eos=True)
    for _, sparsity in runs:
        with Engine(model, sparsity, max_batch=args.samples) as engine:  # its pool goes at once
            engine.generate([short], params)


def run_engine(model, prompt, args, sparsity, label):
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, temperature=args.temperature,
                            seed=0, ignore_eos=True)
    t0 = time.perf_counter()
    with Engine(model, sparsity, max_batch=args.samples,
                cascade=False if args.no_cascade else None) as engine:  # the next run gets its memory
        out = engine.generate([prompt], params)
        total = time.perf_counter() - t0
    s = engine.stats
    assert all(len(c.token_ids) == args.new_tokens for c in out[0])
    return {"engine": label, "total_s": total, "prefill_s": s.prefill_s, "decode_s": s.decode_s,
            "decode_steps": s.decode_steps, "step_ms": 1e3 * float(np.mean(s.step_times)),
            "median_step_ms": 1e3 * float(np.median(s.step_times)),
            "mean_budget": s.budget_sum / max(s.decode_tokens, 1)}, engine.budget_at


def run_hf(args, prompt, device, dtype):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(embedded_checkpoint(), dtype=dtype).to(device)
    hf.eval()
    x = torch.tensor([prompt] * args.samples, device=device)
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
    assert out.shape[1] - len(prompt) == args.new_tokens
    steps = np.diff(stamps)
    del hf
    return {"engine": "hf-generate", "total_s": total, "prefill_s": stamps[0] - t0,
            "decode_s": float(steps.sum()), "decode_steps": len(steps),
            "step_ms": 1e3 * float(steps.mean()) if len(steps) else float("nan"),
            "median_step_ms": 1e3 * float(np.median(steps)) if len(steps) else float("nan"),
            "mean_budget": 0.0}


def run_vllm(args, prompt, cfg, dtype: str):
    """vLLM dense on the same workload: start-up, an untimed warm-up, then the timed generate."""
    from sparrow.stages.rollout.vllm_backend import VllmSampler, vllm_checkpoint

    sampler = VllmSampler(vllm_checkpoint(args.model), dtype=dtype, seed=0, max_batch=args.samples,
                          max_model_len=len(prompt) + args.new_tokens, eos_ids=cfg.eos_token_ids)
    startup = sampler.timing.startup_s
    g = torch.Generator().manual_seed(1)  # another prompt: the warm-up leaves no prefix to reuse
    other = torch.randint(0, cfg.vocab_size, (256,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, temperature=args.temperature,
                            seed=0, ignore_eos=True)
    sampler.generate([other], SamplingParams(max_new_tokens=8, n=args.samples,
                                             temperature=args.temperature, ignore_eos=True))
    sampler.llm.reset_prefix_cache()
    out = sampler.generate([prompt], params)
    t = sampler.timing
    assert all(len(c.token_ids) == args.new_tokens for c in out[0])
    step_ms = 1e3 * t.decode_s / max(args.new_tokens - 1, 1)
    del sampler
    return {"engine": f"vllm-{dtype}", "total_s": t.seconds, "setup_s": startup, "prefill_s": t.prefill_s,
            "decode_s": t.decode_s, "decode_steps": args.new_tokens - 1, "step_ms": step_ms,
            "median_step_ms": float("nan"), "mean_budget": 0.0}


def parse_schedule(spec: str | None) -> Schedule:
    """A schedule artifact, 'published:MODEL:THRESHOLD', or the CPU default for SmolLM2's 8K context."""
    if spec is None:
        return Schedule((0, 4096, 6656), (256, 512, 768))
    if spec.startswith("published:"):
        _, model, threshold = spec.split(":")
        budgets = published_budgets(model, float(threshold))
        if budgets is None:
            raise SystemExit(f"--schedule {spec}: no published schedule for {model} at {threshold}")
        return Schedule(tuple(PUBLISHED_BIN * i for i in range(len(budgets))), budgets)
    return Schedule.from_artifact(spec)


def make_prompt(loaded, args) -> list[int]:
    """The kv_lookup prompt of about --context tokens; random token ids for random weights."""
    if args.random_weights or loaded.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, loaded.config.vocab_size, (args.context,), generator=g).tolist()
    row = make_prompts("kv_lookup", 1, 0, loaded.tokenizer, context_tokens=args.context)[0]
    return list(row["prompt_token_ids"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=6000, help="prompt tokens (kv_lookup)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--schedule", default=None, help="a schedule artifact or published:MODEL:THRESHOLD "
                    "(default: 256 below 4K tokens, 512 to 6.5K, 768 beyond)")
    ap.add_argument("--random-weights", action="store_true", help="random weights for a shapes-only "
                    "preset such as qwen3-4b (timing only; random prompt tokens, no HF baseline)")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else dtype
    schedule = parse_schedule(args.schedule)
    t0 = time.perf_counter()
    loaded = load_model(args.model, device=str(device), dtype=dtype, random_weights=args.random_weights)
    load_s = time.perf_counter() - t0
    model, cfg = loaded.model, loaded.config
    prompt = make_prompt(loaded, args)
    w_bytes = weight_bytes(model)
    elem = torch.tensor([], dtype=dtype).element_size()

    rows = []
    runs = (("dense", None), (f"sparse-{args.budget}", args.budget), ("sparse-schedule", schedule))
    runs = runs[:2] if args.no_schedule else runs
    warm_up(model, prompt, args, runs)
    for label, sparsity in runs:
        row, budget_at = run_engine(model, prompt, args, sparsity, label)
        row["setup_s"] = load_s
        for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
            row[key] = kv_bytes_per_step(cfg, len(prompt), args.new_tokens, args.samples, budget_at, (0, 1),
                                         elem, shared_once=once)
        rows.append(row)
        print(f"  {label}: {row['total_s']:.1f} s", flush=True)
    if not (args.no_vllm or args.random_weights) and importlib.util.find_spec("vllm") is not None:
        for vdtype in (args.vllm_dtype or str(dtype).removeprefix("torch.")).split(","):
            row = run_vllm(args, prompt, cfg, vdtype)
            velem = torch.tensor([], dtype=getattr(torch, vdtype)).element_size()
            row["weight_bytes"] = w_bytes * velem // elem
            for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
                row[key] = kv_bytes_per_step(cfg, len(prompt), args.new_tokens, args.samples, None, (0, 1),
                                             velem, shared_once=once)
            rows.append(row)
            print(f"  {row['engine']}: {row['total_s']:.1f} s (+ {row['setup_s']:.0f} s start-up)",
                  flush=True)
    if not (args.no_hf or args.random_weights):
        row = run_hf(args, prompt, device, dtype)
        row["setup_s"] = float("nan")  # not timed (from_pretrained)
        for key, once in (("kv_bytes_per_step", False), ("kv_unique_bytes_per_step", True)):
            row[key] = kv_bytes_per_step(cfg, len(prompt), args.new_tokens, args.samples, None, (0, 1),
                                         elem, shared_once=once)
        rows.append(row)
        print(f"  hf-generate: {row['total_s']:.1f} s", flush=True)

    # measured after the runs: its 2 GiB of fresh memory slowed the next prefill from about 15 to 29 s
    bw = copy_bandwidth(device)
    tokens = args.samples * args.new_tokens
    decode_tokens = args.samples * (args.new_tokens - 1)
    dense = rows[0]
    for r in rows:
        r["tok_s"] = tokens / r["total_s"]
        r["decode_tok_s"] = decode_tokens / r["decode_s"] if r["decode_s"] > 0 else float("nan")
        r["x_dense_decode"] = r["decode_tok_s"] / (decode_tokens / dense["decode_s"])
        wb = r.setdefault("weight_bytes", w_bytes)
        r["command_s"] = r["setup_s"] + r["total_s"]
        r["bytes_per_step"] = wb + r["kv_bytes_per_step"]
        r["bw_fraction_requested"] = r["bytes_per_step"] / (r["step_ms"] / 1e3) / bw
        r["floor_ms"] = 1e3 * (wb + r["kv_unique_bytes_per_step"]) / bw  # shared pages read once
        r["x_floor"] = r["step_ms"] / r["floor_ms"]
        r["bw_fraction"] = 1 / r["x_floor"]
        r.update(prompt_tokens=len(prompt), samples=args.samples, new_tokens=args.new_tokens,
                 device=str(device), threads=torch.get_num_threads(), copy_gb_s=bw / 1e9)
    print(f"{loaded.name}, prompt {len(prompt)} tokens, {args.samples} samples x {args.new_tokens} new "
          f"tokens (EOS ignored, temperature {args.temperature}), {device} "
          f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"copy bandwidth {bw / 1e9:.1f} GB/s, weights {w_bytes / 1e6:.0f} MB")
    head = (f"{'engine':>16} {'command s':>9} {'total s':>8} {'prefill s':>9} {'decode s':>9} {'tok/s':>7} "
            f"{'dec tok/s':>9} {'x dense':>7} {'step ms':>8} {'median':>7} {'MB/step':>8} {'BW frac':>7} "
            f"{'floor ms':>8} {'x floor':>7}")
    print(head)
    for r in rows:
        print(f"{r['engine']:>16} {r['command_s']:>9.1f} {r['total_s']:>8.1f} {r['prefill_s']:>9.1f} "
              f"{r['decode_s']:>9.1f} "
              f"{r['tok_s']:>7.1f} {r['decode_tok_s']:>9.1f} {r['x_dense_decode']:>7.2f} "
              f"{r['step_ms']:>8.1f} {r['median_step_ms']:>7.1f} {r['bytes_per_step'] / 1e6:>8.0f} "
              f"{r['bw_fraction']:>7.2f} {r['floor_ms']:>8.1f} {r['x_floor']:>7.2f}")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}; CUDA graphs for the decode step")
    write_results(rows, "rollout")


if __name__ == "__main__":
    main()
