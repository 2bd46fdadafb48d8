"""Where a CPU decode step's time goes: the engine's step alone, timed and profiled (torch.profiler).

One prompt of --context random tokens shared by --samples samples (so cascade attention applies), at
--budget (0 = dense) in --dtype. After the prefill and a few warm-up steps, times --steps decode steps
one by one (median and fastest, in ms: this VM's speed moves, so compare within one run) and, with
--profile, prints the ATen ops by self CPU time over three more steps. The gap between the ops' total and
the wall time is Python between the ops. `bench/rollout.py` measures whole commands against vLLM; this
is for finding what to make faster. Writes nothing; prints.

    .venv/bin/python bench/cpu_step.py --budget 512 --dtype bfloat16 --profile
"""

from __future__ import annotations

import time

import numpy as np
import torch
from common import bench_parser

from sparrow.stages.core.definitions import validate_budget
from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import Engine, EngineConfig, SamplingParams
from sparrow.stages.model.loading import load_model


def parse():
    ap = bench_parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=6000, help="prompt tokens")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--budget", type=int, default=0, help="0 = dense")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cascade", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if args.budget:
        try:
            validate_budget(args.budget)
        except ValueError as e:
            ap.error(f"--budget: {e}")
    return args


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    prompt = torch.randint(100, loaded.config.vocab_size, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    config = EngineConfig(max_batch=args.samples, cascade=False if args.no_cascade else None)
    engine = Engine(loaded.model, as_policy(args.budget or None), config)
    params = SamplingParams(max_new_tokens=args.steps + 16, n=args.samples, temperature=1.0, seed=0,
                            ignore_eos=True)
    engine.add_request(prompt, params)
    for _ in range(4):  # the prefill, then warm-up steps
        engine.step()
    seconds = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - t0)
    name = f"budget {args.budget}" if args.budget else "dense"
    print(f"{args.model}, {name}, {args.dtype}, {args.samples} samples at {args.context} tokens, "
          f"{args.threads} threads: step median {1e3 * np.median(seconds):.1f} ms, "
          f"fastest {1e3 * min(seconds):.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print("three steps:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
