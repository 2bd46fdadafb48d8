"""Where a decode step's time goes, on a GPU: device time per kernel over a few steps (torch.profiler).

The engine runs its static decode step eagerly here (`DecodeStep.EAGER`, the same kernels the CUDA
graphs replay, but visible one by one to the profiler), after a warm-up, for one prompt of --context
tokens with --samples samples sharing its pages; then the same number of steps replayed from CUDA
graphs, timed by wall clock. Prints the kernels by total device time per step, the device time per step
against the graph-replayed wall time per step, and the share of attention, selection, GEMMs, the fused
elementwise kernels (norms, q/k norm + rotary + KV append, SiLU x up) and the rest. `--modular` runs the
model's modular decode forward instead of the GPU runner's inference form (stacked projections, fused
kernels: stages/engine/gpu/layers.py), to compare the two in the same session.

    python bench/step_profile.py --model qwen3-4b --context 32768 --samples 32 --budget 2048
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from common import bench_parser

from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import DecodeStep, Engine, EngineConfig, SamplingParams
from sparrow.stages.model.loading import load_model

GROUPS = (("attention", ("paged_decode", "merge_splits")), ("selection", ("page_scores", "select")),
          ("kv append", ("append_kv",)), ("fused elementwise", ("add_rms_norm", "qk_norm_rope", "silu_mul")),
          ("gemm", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas")))


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


def engine_steps(model, prompt, args, step: DecodeStep):
    """An engine past its prefill and warm-up steps, ready for timed decode steps."""
    config = EngineConfig(max_batch=args.samples, decode_step=step)
    engine = Engine(model, as_policy(args.budget or None), config)
    if args.modular:
        engine.runner.decode_form = None  # before the first step builds the static step
    params = SamplingParams(max_new_tokens=args.warmup + 2 * args.steps + 2, n=args.samples, temperature=1.0,
                            seed=0, ignore_eos=True)
    engine.add_request(prompt, params)
    for _ in range(1 + args.warmup):  # prefill, then warm-up decode steps (graph capture, compiles)
        engine.step()
    torch.cuda.synchronize()
    return engine


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048, help="0 = dense")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--modular", action="store_true", help="the model's modular decode forward (no fusion)")
    args = ap.parse_args()
    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (args.context,), generator=g).tolist()

    engine = engine_steps(loaded.model, prompt, args, DecodeStep.GRAPHS)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    graph_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as host:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    engine.close()  # its pool and graphs go now, before the eager engine sizes its own

    engine = engine_steps(loaded.model, prompt, args, DecodeStep.EAGER)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] += t / 1e3 / args.steps  # ms per step
    total = sum(kernels.values())
    mode = f"budget {args.budget}" if args.budget else "dense"
    mode += ", modular step" if args.modular else ", fused step"
    print(f"{args.model}, prompt {args.context}, {args.samples} samples, {mode}: device time {total:.2f} "
          f"ms/step (eager kernels), graph-replayed step {graph_ms:.2f} ms wall")
    groups: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        groups[group_of(name)] += ms
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<10} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    print(f"{'ms/step':>8} {'share':>6}  kernel")
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:8.3f} {100 * ms / total:5.1f}%  {name[:110]}")
    print("host side of the graph-replayed step, by self CPU time (ms/step, calls/step):")
    ops = sorted(host.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
    for e in ops:
        print(f"{e.self_cpu_time_total / 1e3 / args.steps:8.3f} {e.count / args.steps:7.1f}  {e.key[:100]}")


if __name__ == "__main__":
    main()
